"""``python -m poprun ...``: the same as the ``poprun`` command."""
import sys

from .cli import main

sys.exit(main())
