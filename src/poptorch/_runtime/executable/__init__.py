"""The compiled program as a thing that outlives its process: its input signature
(signature.py), its artefacts (artifacts.py), the executable cache (cache.py) and where
an executor's program comes from (source.py)."""
