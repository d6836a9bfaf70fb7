"""``benchmarks/bench_instructions.py`` without valgrind: its reading of callgrind's dump
files (one count per toggled window, in order) and its report's ratios, computed here
from the same figures; and the clear message where valgrind is missing."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_instructions", os.path.join(ROOT, "benchmarks", "bench_instructions.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dumps_are_read_in_window_order(tmp_path):
    bench = _bench()
    prefix = str(tmp_path / "cg")
    for k, total in enumerate((507_217, 6_362_701, 59_171_293), start=1):
        (tmp_path / f"cg.{k}").write_text(f"version: 1\nsummary: 0\ntotals: {total}\n")
    (tmp_path / "cg").write_text("totals: 1\n")  # the final dump at exit: not a window
    assert bench._totals(prefix) == [507_217, 6_362_701, 59_171_293]


def test_the_report_divides_the_eager_count_by_poptorchs(capsys):
    bench = _bench()
    eager, pop = 163_813.0, 212_081.0
    bench.report([{"workload": "tiny", "mode": "infer", "d": 16,
                   "per_microbatch": {"eager": eager, "pop-eager": pop}}])
    line = [row for row in capsys.readouterr().out.splitlines()
            if row.startswith("tiny")][0].split()
    assert float(line[5]) == round(eager / pop, 3)
    assert line[6] == f"{(pop - eager) * 16:+,.0f}"


def test_without_valgrind_it_says_what_to_install(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(bench.shutil, "which", lambda tool: None)
    assert bench.main(["--quick"]) == 0
    assert "install valgrind" in capsys.readouterr().out
