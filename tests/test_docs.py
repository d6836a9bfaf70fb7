"""The documentation site: it builds without a warning and its examples run.

Every ```python block of a page of the site runs, in page order, in one namespace per
page (a page reads like one script), in a scratch folder. Shell blocks (```bash:
installation, torchrun commands) are shown, not run; each page that shows a torchrun
command also holds the script it launches as a Python block, which does run.
"""
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


def site_pages():
    """The pages listed in mkdocs.yml's nav (the site), in nav order."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M)


def python_blocks(page):
    text = (DOCS / page).read_text()
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


def test_every_page_is_in_the_site_and_every_block_says_its_language():
    pages = site_pages()
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} - {"design.md"}
    assert set(pages) == on_disk, "add the page to mkdocs.yml's nav (or remove it)"
    for page in pages:
        for lang, _ in FENCE.findall((DOCS / page).read_text()):
            assert lang, f"{page}: a code block without a language (python, bash, text)"


@pytest.mark.parametrize("page", [p for p in site_pages() if python_blocks(p)])
def test_page_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    # A real module, so that classes defined by the page can be pickled (saved models).
    module = types.ModuleType(f"docs_{page.replace('/', '_').replace('-', '_')[:-3]}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for n, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page} (python block {n + 1})", "exec")
        exec(code, module.__dict__)  # pylint: disable=exec-used
    from poptorch._runtime import tracing
    tracing.finish()  # a page that profiles writes its trace now, not at exit


def test_site_builds_without_warnings(tmp_path):
    pytest.importorskip("mkdocs", reason="install the docs extra: pip install -e .[docs]")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
         str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in result.stderr, result.stderr[-4000:]
    for page in site_pages():
        built = tmp_path / "site" / page.replace(".md", "") / "index.html"
        if page == "index.md":
            built = tmp_path / "site" / "index.html"
        assert built.exists(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("trainingModel", "inferenceModel", "PoplarExecutor", "compileAndExport",
                 "Options", "DataLoader", "Channel"):
        assert name in api, name


def test_the_options_table_covers_every_setter():
    import inspect

    import poptorch
    helpers = {"checkIsFrozen", "createOrSet", "deleteIfExists", "toDict", "clone", "set",
               "exists", "from_json", "loadFromFile", "update", "get"}

    def setters(obj, prefix):
        cls = type(obj)
        return {prefix + name for name in dir(cls)
                if not name.startswith("_") and name not in helpers
                and callable(getattr(cls, name))
                and not isinstance(inspect.getattr_static(cls, name), property)}

    opts = poptorch.Options()
    expected = setters(opts, "") | {"Jit.backend"}
    for sub in ("Training", "Precision", "TensorLocations", "Jit", "Distributed",
                "_Popart"):
        expected |= setters(getattr(opts, sub), sub + ".")
    table = (DOCS / "option-effects.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", table, re.M))
    assert expected <= listed, sorted(expected - listed)
    labels = {"changes results", "speed only", "speed and memory only", "memory only",
              "reporting only", "checks only", "recorded, no effect"}
    for row in re.findall(r"^\| `[\w.]+` \| ([^|]+) \| ([^|]+) \|", table, re.M):
        assert {cell.strip() for cell in row} <= labels, row
