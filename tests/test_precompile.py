"""Precompilation (compileAndExport / save / poptorch.load / loadExecutable) and
executable caching, against models that were never interrupted."""
import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch
from poptorch._runtime.executable import artifacts, cache as executable_cache


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, torch.nn.functional.cross_entropy(out, y)


def batches(n, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


def train_opts(backend="eager"):
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    opts.Jit.backend(backend)
    return opts


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=False):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- eager
def test_saved_training_continues_bitwise_like_the_uninterrupted_model(tmp_path):
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    data = batches(5)
    pop = poptorch.trainingModel(model, train_opts(),
                                 torch.optim.Adam(model.parameters(), lr=0.01))
    ref = poptorch.trainingModel(twin, train_opts(),
                                 torch.optim.Adam(twin.parameters(), lr=0.01))
    for x, y in data[:2]:
        pop(x, y)
        ref(x, y)
    path = str(tmp_path / "net.popef")
    pop.save(path)
    restored = poptorch.load(path)
    for x, y in data[2:]:
        restored(x, y)
        ref(x, y)
    assert_bitwise(params(restored.model), params(twin))
    # and the plain-PyTorch loop agrees with both (same maths, other rounding)
    torch.manual_seed(0)
    plain = Net()
    opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for x, y in data:
        for step in range(2):
            opt.zero_grad()
            for x_mb, y_mb in zip(x[step * 4:(step + 1) * 4].split(2),
                                  y[step * 4:(step + 1) * 4].split(2), strict=False):
                (plain(x_mb, y_mb)[1] / 2).backward()
            opt.step()
    for p, q in zip(plain.parameters(), twin.parameters(), strict=False):
        assert (p - q).abs().max() <= 1e-5


def test_compile_and_export_leaves_the_model_untouched(tmp_path):
    torch.manual_seed(0)
    model = Net()
    before = params(model)
    x, y = batches(1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pop = poptorch.trainingModel(model, train_opts(), opt)
    path = str(tmp_path / "net.popef")
    pop.compileAndExport(path, x, y)
    assert_bitwise(params(model), before)
    assert not opt.state  # no momentum from a hidden step
    meta = poptorch.importPoptorchMetadataFromFile(path)
    assert meta["training"] is True


def test_export_to_a_directory_or_a_missing_folder(tmp_path, caplog):
    torch.manual_seed(0)
    model = Net().eval()
    x, y = batches(1)[0]
    pop = poptorch.inferenceModel(model)
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        pop.compileAndExport(str(tmp_path), x, y)  # a directory: <dir>/model.poptorch
    assert os.listdir(tmp_path) == ["model.poptorch"]
    assert any("is a directory" in r.getMessage() for r in caplog.records)
    nested = tmp_path / "new" / "folder" / "net.poptorch"  # parents are created
    pop.save(str(nested))
    for path in (tmp_path / "model.poptorch", nested):
        loaded = poptorch.load(str(path))
        assert_bitwise(loaded(x, y), model(x, y))


@pytest.mark.parametrize("training", [True, False])
def test_loaded_model_refuses_inputs_that_differ_from_the_export(tmp_path, training):
    model = Net()
    x, y = batches(1)[0]
    if training:
        pop = poptorch.trainingModel(model, train_opts())
    else:
        pop = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    path = str(tmp_path / "net.popef")
    pop.compileAndExport(path, x, y)
    restored = poptorch.load(path)
    before = params(restored.model)
    with pytest.raises(poptorch.Error, match=r"input 0 is a float32 tensor of shape "
                                             r"\[16, 6\].*compiled for a float32 tensor "
                                             r"of shape \[8, 6\]"):
        restored(torch.randn(16, 6), torch.randint(0, 3, (16,)))
    with pytest.raises(poptorch.Error, match="input 1 is a float32 tensor"):
        restored(x, y.float())
    with pytest.raises(poptorch.Error, match="compiled for"):
        restored(x)
    assert_bitwise(params(restored.model), before)  # nothing ran
    out, loss = restored(x, y)  # the exported inputs still run
    expected = model(x, y)[0] if not training else None
    if expected is not None:
        assert torch.equal(out, expected)
    with pytest.raises(poptorch.Error, match="shape"):  # after compiling too
        restored(torch.randn(16, 6), torch.randint(0, 3, (16,)))


def test_load_executable_without_the_exported_model_and_edit_opts(tmp_path):
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    data = batches(3)
    pop = poptorch.trainingModel(model, train_opts(),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ref = poptorch.trainingModel(twin, train_opts(),
                                 torch.optim.SGD(twin.parameters(), lr=0.1))
    pop(*data[0])
    ref(*data[0])
    path = str(tmp_path / "net.popef")
    pop.save(path, export_model=False)
    with pytest.raises(poptorch.Error, match="export_model=False"):
        poptorch.load(path)
    fresh = Net()  # the user rebuilds the model, then loads the executable into it
    again = poptorch.trainingModel(fresh, train_opts(),
                                   torch.optim.SGD(fresh.parameters(), lr=0.1))
    again.loadExecutable(path)
    with pytest.raises(poptorch.Error, match="shape"):
        again(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    for x, y in data[1:]:
        again(x, y)
        ref(x, y)
    assert_bitwise(params(fresh), params(twin))
    # edit_opts_fn sees (and may change) a copy of the saved options
    full = str(tmp_path / "full.popef")
    pop.save(full)
    seen = []
    restored = poptorch.load(full, edit_opts_fn=lambda o: seen.append(o.device_iterations))
    assert seen == [2] and restored.options.device_iterations == 2
    inference = poptorch.inferenceModel(Net())
    with pytest.raises(poptorch.Error, match="training model"):
        inference.loadExecutable(full)


# -------------------------------------------------------------------- cache entries
def fake_artifacts():
    data = b"\x7fELF not really"
    import hashlib
    return {"format": artifacts.FORMAT, "torch": str(torch.__version__), "cache": b"x",
            "binaries": {"ab/cabc.so": (hashlib.sha256(data).hexdigest(), data)}}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign", "other-torch",
                                    "bad-binary"])
def test_corrupt_or_foreign_cache_entries_are_ignored_with_a_warning(tmp_path, caplog,
                                                                     damage):
    key = "k" * 40
    entry = fake_artifacts()
    if damage == "other-torch":
        entry["torch"] = "1.0.0"
    if damage == "bad-binary":
        rel = "ab/cabc.so"
        entry["binaries"][rel] = (entry["binaries"][rel][0], b"tampered")
    path = executable_cache.write(str(tmp_path), "o" * 40 if damage == "foreign" else key,
                                  entry)
    if damage == "foreign":
        os.replace(path, executable_cache.entry_path(str(tmp_path), key))
    target = executable_cache.entry_path(str(tmp_path), key)
    raw = open(target, "rb").read()
    if damage == "truncate":
        open(target, "wb").write(raw[: len(raw) // 2])
    if damage == "garbage":
        open(target, "wb").write(os.urandom(300))
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        assert executable_cache.read(str(tmp_path), key) is None
    assert "ignoring" in caplog.text and target in caplog.text


def test_a_sound_cache_entry_reads_back():
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        entry = fake_artifacts()
        executable_cache.write(folder, "k" * 40, entry)
        assert executable_cache.read(folder, "k" * 40) == entry
        assert executable_cache.read(folder, "m" * 40) is None  # missing: no warning


def test_cache_key_covers_options_model_inputs_and_versions():
    model = Net()
    sig = poptorch._runtime.executable.signature.InputSignature.of(*((torch.zeros(8, 6),), {}))

    def key(**change):
        parts = dict(backend="inductor", training=True, options=train_opts(), model=model,
                     optimizer=None, signature=sig, version="3.4.0")
        parts.update(change)
        parts["options"] = parts["options"].toDict()
        return executable_cache.cache_key(**parts)

    base = key()
    assert base == key()  # stable
    assert key(options=train_opts().deviceIterations(4)) != base
    moved = train_opts().enableExecutableCaching("elsewhere").modelName("m")
    assert key(options=moved) == base  # where things go is not what is computed
    assert key(training=False) != base
    assert key(version="3.4.1") != base
    assert key(backend="other") != base
    wider = Net()
    wider.fc2 = torch.nn.Linear(8, 4)
    assert key(model=wider) != base
    other_sig = poptorch._runtime.executable.signature.InputSignature.of((torch.zeros(4, 6),), {})
    assert key(signature=other_sig) != base
    assert key(optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) != base


# ----------------------------------------------------------------------- inductor
CHILD = textwrap.dedent("""
    import json, os, sys, torch, poptorch
    from torch._dynamo.utils import counters
    sys.path.insert(0, {tests!r})
    from test_precompile import Net, batches
    restored = poptorch.load({path!r})
    shipped = set(torch.load({path!r}, weights_only=False)["compiled"]["binaries"])
    root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    for x, y in batches(4, seed=1):
        restored(x, y)
    present = {{os.path.relpath(os.path.join(d, f), root)
                for d, _, fs in os.walk(root) for f in fs if f.endswith(".so")}}
    torch.save([p.detach() for p in restored.model.parameters()], {out!r})
    print(json.dumps({{"built": sorted(present - shipped),
                       "misses": counters["inductor"]["fxgraph_cache_miss"]}}))
""")


@pytest.mark.slow
def test_inductor_precompiled_training_runs_in_a_fresh_process_without_compiling(
        tmp_path):
    pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    opt_args = dict(lr=0.01)
    pop = poptorch.trainingModel(model, train_opts("inductor"),
                                 torch.optim.Adam(model.parameters(), **opt_args))
    x, y = batches(1, seed=1)[0]
    path = str(tmp_path / "net.popef")
    pop.compileAndExport(path, x, y)
    payload = torch.load(path, weights_only=False)
    assert payload["compiled"] is not None and payload["compiled"]["binaries"]
    out = str(tmp_path / "params.pt")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "fresh-inductor"),
               POPTORCH_LOG_LEVEL="WARN")
    code = CHILD.format(tests=os.path.dirname(__file__), path=path, out=out)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import json
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"built": [], "misses": 0}, report
    # The uninterrupted model takes the same steps here. Not bitwise: the compiled
    # step compiles at a model's second call, so the loaded model's first step runs
    # eagerly (other rounding) while the uninterrupted one's is compiled.
    for xb, yb in batches(4, seed=1):
        pop(xb, yb)
    for p, q in zip(torch.load(out), params(model), strict=False):
        assert (p - q).abs().max() <= 1e-6
    # ... and agrees with eager PyTorch within rounding.
    ref = poptorch.trainingModel(twin, train_opts("eager"),
                                 torch.optim.Adam(twin.parameters(), **opt_args))
    for xb, yb in batches(4, seed=1):
        ref(xb, yb)
    for p, q in zip(model.parameters(), twin.parameters(), strict=False):
        assert (p - q).abs().max() <= 1e-5


@pytest.mark.slow
def test_inductor_cache_survives_a_corrupted_entry(tmp_path, caplog):
    pytest.importorskip("torch._inductor")
    cache = tmp_path / "cache"
    x, y = batches(1)[0]

    def run():
        torch.manual_seed(0)
        model = Net()
        opts = poptorch.Options().enableExecutableCaching(str(cache))
        opts.Jit.backend("inductor")
        pop = poptorch.inferenceModel(model, opts)
        out = pop(x, y)[0]
        assert (out - model(x, y)[0]).abs().max() <= 1e-5
        return out

    first = run()
    entries = list(cache.glob("*.popcache"))
    assert len(entries) == 1
    entries[0].write_bytes(entries[0].read_bytes()[:100])  # truncated by a crash
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        second = run()
    assert "ignoring" in caplog.text
    assert torch.equal(first, second)
    fixed = list(cache.glob("*.popcache"))
    assert len(fixed) == 1 and fixed[0].stat().st_size > 100  # replaced by a sound one
