"""Checkpoint and resume (docs/data.md): K training steps, a checkpoint, a new process that
restores it and trains K more steps gives bitwise the weights, buffers and optimizer state
of 2K uninterrupted steps; Sync and Async loaders, 0 and 2 workers, with a seeded and an
unseeded shuffle (the global RNG then drives both the shuffle and dropout).

The reference (2K steps) and the first K steps run in one subprocess, the resumed K steps
in another, so that nothing but the checkpoint carries over.
"""
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

import poptorch
from poptorch import DataLoaderMode

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create")]

PROGRAM = textwrap.dedent('''
    import copy
    import os
    import sys
    import torch
    import poptorch
    from torch.utils.data import TensorDataset

    # Sync and Async, 0 and 2 workers, each once with a seeded and once with an unseeded
    # shuffle (all 8 combinations with POPTORCH_LONG_TESTS=1).
    CONFIGS = [("Sync", 0, 7), ("Sync", 2, None), ("Async", 0, None), ("Async", 2, 7)]
    if os.environ.get("POPTORCH_LONG_TESTS"):
        CONFIGS += [("Sync", 0, None), ("Sync", 2, 7), ("Async", 0, 7), ("Async", 2, None)]
    K = 13  # 12 batches an epoch: the checkpoint falls inside the second epoch


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 16)
            self.bn = torch.nn.BatchNorm1d(16)
            self.fc2 = torch.nn.Linear(16, 3)

        def forward(self, x, y):
            h = torch.nn.functional.dropout(torch.relu(self.bn(self.fc1(x))), 0.3,
                                            training=self.training)
            out = self.fc2(h)
            return out, torch.nn.functional.cross_entropy(out, y)


    def build(mode, workers, seed, checkpoint=None):
        torch.manual_seed(0)
        opts = poptorch.Options()
        if seed is not None:
            opts.randomSeed(seed)
        opts.Training.setAutomaticLossScaling(True)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(48, 6, generator=g),
                             torch.randint(0, 3, (48,), generator=g))
        loader = poptorch.DataLoader(opts, data, batch_size=4, shuffle=True,
                                     num_workers=workers,
                                     mode=getattr(poptorch.DataLoaderMode, mode))
        model = Net()
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                       loss_scaling=64.0)
        if checkpoint is not None:  # the documented restore, step by step
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            loader.load_state_dict(checkpoint["loader"])
        training = poptorch.trainingModel(model, opts, optimizer=optimizer)
        if checkpoint is not None:
            training.compile(torch.zeros(4, 6), torch.zeros(4, dtype=torch.long))
            if checkpoint["model_rng"][0] is not None:
                training.rng_state = checkpoint["model_rng"]
            torch.set_rng_state(checkpoint["torch_rng"])
        return training, optimizer, loader


    def train(training, loader, steps):
        done = 0
        while done < steps:
            for x, y in loader:
                training(x, y)
                done += 1
                if done == steps:
                    break


    def steps(training, loader):
        """Trains one step per next(), epoch after epoch."""
        while True:
            for x, y in loader:
                training(x, y)
                yield


    def state(training, optimizer):
        return {"model": training.state_dict(), "optimizer": optimizer.state_dict()}


    def first(path):
        # K steps, the checkpoint, then K more in the same run: the uninterrupted 2K
        # reference (taking a checkpoint must not change the run either)
        out = {}
        for config in CONFIGS:
            training, optimizer, loader = build(*config)
            iterator = steps(training, loader)
            for _ in range(K):
                next(iterator)
            # copies: state dicts share tensors with the live model and optimizer
            checkpoint = copy.deepcopy({
                "model": training.state_dict(), "optimizer": optimizer.state_dict(),
                "model_rng": training.rng_state, "torch_rng": torch.get_rng_state(),
                "loader": loader.state_dict()})
            halfway = copy.deepcopy(state(training, optimizer))
            for _ in range(K):
                next(iterator)
            out[config] = {"reference": state(training, optimizer),
                           "checkpoint": checkpoint, "halfway": halfway}
            loader.terminate()
        torch.save(out, path)


    def second(path, result):
        saved = torch.load(path, weights_only=False)
        out = {}
        for config in CONFIGS:
            training, optimizer, loader = build(*config, saved[config]["checkpoint"])
            train(training, loader, K)
            out[config] = state(training, optimizer)
            loader.terminate()
        torch.save(out, result)


    if __name__ == "__main__":
        {"first": first, "second": second}[sys.argv[1]](*sys.argv[2:])
''')


def flat(state, prefix=""):
    """(name, tensor or value) pairs of a nested state dict, in a stable order."""
    if isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from flat(state[key], f"{prefix}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from flat(value, f"{prefix}/{i}")
    else:
        yield prefix, state


def assert_bitwise_equal(got, want):
    got, want = dict(flat(got)), dict(flat(want))
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def run(*args):
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_k_steps_checkpoint_new_process_k_steps_equals_2k_steps(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    run(str(script), "first", str(tmp_path / "first.pt"))
    run(str(script), "second", str(tmp_path / "first.pt"), str(tmp_path / "second.pt"))
    first = torch.load(tmp_path / "first.pt", weights_only=False)
    second = torch.load(tmp_path / "second.pt", weights_only=False)
    assert len(second) >= 4
    for config, resumed in second.items():
        reference = first[config]["reference"]
        assert_bitwise_equal(resumed, reference)
        # the test can fail: halfway weights differ from the final ones
        halfway = first[config]["halfway"]["model"]
        assert not all(torch.equal(halfway[k], reference["model"][k])
                       for k in reference["model"])


# -- the loader's position on its own (in-process, cheap) ----------------------------
def _stream(loader, count, resume=None):
    if resume is not None:
        loader.load_state_dict(resume)
    out = []
    while len(out) < count:
        for batch in loader:
            out.append(batch[0].clone())
            if len(out) == count:
                break
    return out, loader.state_dict()


@pytest.mark.parametrize("mode", [DataLoaderMode.Sync, DataLoaderMode.Async])
@pytest.mark.parametrize("count", [5, 8])  # inside an epoch, at its very end
def test_position_restores_the_shuffle_order(mode, count):
    """The global RNG draws the order (no seed): after a restore the stream continues
    exactly, and the caller's RNG is where it would have been."""
    data = TensorDataset(torch.arange(32))

    def make():
        return poptorch.DataLoader(poptorch.Options(), data, batch_size=4, shuffle=True,
                                   mode=mode)

    torch.manual_seed(3)
    full, _ = _stream(make(), 2 * count)
    after_full = torch.rand(3)
    torch.manual_seed(3)
    head, saved = _stream(make(), count)
    rng = torch.get_rng_state()
    torch.manual_seed(99)
    resumed_loader = make()
    torch.set_rng_state(rng)
    tail, _ = _stream(resumed_loader, count, saved)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full, strict=True))
    assert torch.equal(torch.rand(3), after_full)
    # reference: torch's own loader with the same RNG gives the first epoch's order
    torch.manual_seed(3)
    reference = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    assert all(torch.equal(a, b[0]) for a, b in zip(full[:8], reference, strict=False))


def test_iterable_dataset_resumes_by_skipping_batches():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(item,) for item in torch.arange(20).split(1)])

    loader = poptorch.DataLoader(poptorch.Options(), Stream(), batch_size=2)
    head, saved = _stream(loader, 3)
    assert saved["consumed"] == 3 and saved["start"] is None
    tail, _ = _stream(poptorch.DataLoader(poptorch.Options(), Stream(), batch_size=2), 7,
                      saved)
    reference = [b.view(-1) for b in torch.arange(20).split(2)]
    assert all(torch.equal(a.view(-1), b) for a, b in zip(head + tail, reference,
                                                           strict=True))


def test_load_state_dict_rejects_foreign_states():
    loader = poptorch.DataLoader(poptorch.Options(), TensorDataset(torch.arange(8)),
                                 batch_size=2)
    for bad in (None, {}, {"version": 1, "consumed": -1, "start": None, "finished": False},
                {"version": 1, "consumed": 1, "start": "x", "finished": False}):
        with pytest.raises(ValueError, match="state"):
            loader.load_state_dict(bad)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
