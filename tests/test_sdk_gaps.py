"""PopTorch pieces Graphcore's applications use beside the documented API (issue 24):
``torch.ops.poptorch.{push,pop}_name_scope`` and ``internal_cast``, a seeded shuffle in a
spawned loader worker, pickling an optimizer an LR scheduler wrapped, PopART's enums."""
import copy
import io
import pathlib
import pickle
import sys

import pytest
import torch

import poptorch
from poptorch.ops.scopes import current_name_scope


# -- push_name_scope / pop_name_scope ----------------------------------------------------
class Leaf(torch.nn.Linear):
    def __init__(self):
        super().__init__(3, 3)
        self.seen = []

    def forward(self, x):
        self.seen.append(current_name_scope())
        return super().forward(x)


def scoped_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("block", torch.nn.Sequential())
    model.block.add_module("inner", Leaf())
    model.add_module("act", torch.nn.ReLU())
    # as Graphcore's CNN trainer does: a scope per module, named after its last part
    for name, module in model.named_modules():
        if name:
            module.register_forward_pre_hook(
                lambda _m, _i, n=name: torch.ops.poptorch.push_name_scope(n.split(".")[-1]))
            module.register_forward_hook(
                lambda _m, _i, _o: torch.ops.poptorch.pop_name_scope())
    return model


def test_name_scope_ops_name_the_scope_inside_a_model_and_do_nothing_outside():
    model = scoped_model()
    x = torch.randn(2, 3)
    reference = copy.deepcopy(model)(x)         # plain PyTorch: the ops do nothing
    assert reference is not None and current_name_scope() == ""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = poptorch.inferenceModel(model)(x)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    assert model.block.inner.seen == ["block/inner"]
    assert current_name_scope() == ""
    names = {e.name for e in prof.events()}
    assert {"block", "block/inner", "act"} <= names
    model.block.inner.seen.clear()
    model(x)  # outside a PopTorch model again: no scope
    assert model.block.inner.seen == [""]


def test_name_scope_ops_survive_torch_compile():
    def f(x):
        torch.ops.poptorch.push_name_scope("compiled")
        y = x * 2
        torch.ops.poptorch.pop_name_scope()
        return y
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(4)
    from poptorch._runtime.context import running_on_ipu
    with running_on_ipu(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.testing.assert_close(compiled(x), x * 2)
    assert "compiled" in {e.name for e in prof.events()}


def test_pop_name_scope_without_push_is_an_error():
    from poptorch._runtime.context import running_on_ipu
    with running_on_ipu(), pytest.raises(poptorch.Error, match="no name scope is open"):
        torch.ops.poptorch.pop_name_scope()


# -- internal_cast ------------------------------------------------------------------------
def test_internal_cast_casts_and_differentiates_like_tensor_to():
    x = torch.randn(5, requires_grad=True)
    y = torch.ops.poptorch.internal_cast(x, "FLOAT16")
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, x.detach().half(), rtol=0, atol=0)
    (torch.ops.poptorch.internal_cast(y, "FLOAT") * torch.arange(5.0)).sum().backward()
    ref = x.detach().clone().requires_grad_()
    (ref.half().float() * torch.arange(5.0)).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
    with pytest.raises(poptorch.Error, match="unknown dtype 'INT8'"):
        torch.ops.poptorch.internal_cast(x, "INT8")


# -- randomSeed + shuffle with a spawned (SharedMemory) worker ----------------------------
class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def batches(loader, epochs=2):
    return [[b.flatten().tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_seeded_shuffle_reaches_a_spawned_worker_in_the_same_order(num_workers):
    opts = poptorch.Options().randomSeed(7)
    in_process = poptorch.DataLoader(opts.clone(), Numbers(), batch_size=3, shuffle=True,
                                     num_workers=num_workers)
    spawned = poptorch.DataLoader(
        opts.clone(), Numbers(), batch_size=3, shuffle=True, num_workers=num_workers,
        mode=poptorch.DataLoaderMode.Async,
        async_options={"sharing_strategy": poptorch.SharingStrategy.SharedMemory})
    try:
        got = batches(spawned)
    finally:
        spawned.terminate()
    expected = batches(in_process)
    assert got == expected
    # plain torch, same seed: the same order (compared without torch workers: with them
    # poptorch.DataLoader's second epoch differs from plain torch's, on main too)
    plain = torch.utils.data.DataLoader(Numbers(), batch_size=3, shuffle=True,
                                        generator=torch.Generator().manual_seed(7))
    plain_batches = batches(plain)
    assert got[0] == plain_batches[0]
    if num_workers == 0:
        assert got == plain_batches
    assert got[0] != got[1] and sorted(sum(got[0], [])) == [float(i) for i in range(24)]


# -- pickling an optimizer whose step an LR scheduler wrapped ------------------------------
def train(model, opt, sched, steps):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        sched.step()


def roundtrip(obj, how):
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_optimizer_wrapped_by_a_scheduler_pickles_and_resumes(how):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref_model = copy.deepcopy(model)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                             accum_type=torch.float32)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
              for o in (opt, ref_opt)]
    train(model, opt, scheds[0], 2)
    train(ref_model, ref_opt, scheds[1], 2)
    # plain torch goes through the same round trip
    restored = roundtrip({"model": model, "opt": opt}, how)
    ref = roundtrip({"model": ref_model, "opt": ref_opt}, how)
    opt2 = restored["opt"]
    assert opt2.accum_type == torch.float32 and "step" not in opt2.__dict__
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5, last_epoch=2)
              for o in (opt2, ref["opt"])]
    train(restored["model"], opt2, scheds[0], 2)
    train(ref["model"], ref["opt"], scheds[1], 2)
    for p, q in zip(restored["model"].parameters(), ref["model"].parameters(), strict=False):
        torch.testing.assert_close(p, q)


# -- popart enums -------------------------------------------------------------------------
def test_popart_enums_for_recomputation_virtual_graphs_and_batch_serialisation(monkeypatch):
    compat = pathlib.Path(__file__).resolve().parents[1] / "compat" / "popart" / "src"
    monkeypatch.syspath_prepend(str(compat))
    monkeypatch.delitem(sys.modules, "popart", raising=False)
    import popart
    # PopART's values (willow/include/popart/sessionoptions.hpp)
    assert [int(popart.RecomputationType.NoRecompute), int(popart.RecomputationType.Standard),
            int(popart.RecomputationType.NormOnly), int(popart.RecomputationType.Pipeline),
            int(popart.RecomputationType.RecomputeAll)] == [0, 1, 2, 3, 4]
    assert [int(m) for m in (popart.VirtualGraphMode.Off, popart.VirtualGraphMode.Manual,
                             popart.VirtualGraphMode.Auto,
                             popart.VirtualGraphMode.ExecutionPhases)] == [0, 1, 2, 3]
    assert [int(m) for m in (popart.BatchSerializationBatchSchedule.Scheduler,
                             popart.BatchSerializationBatchSchedule.Isomorphic,
                             popart.BatchSerializationBatchSchedule.OverlapOnIo,
                             popart.BatchSerializationBatchSchedule.OverlapOnCompute)] \
        == [0, 1, 2, 3]
    opts = poptorch.Options()  # as Graphcore's CLIP and CNN programs set them
    opts._Popart.set("virtualGraphMode", int(popart.VirtualGraphMode.Manual))
    opts._Popart.set("autoRecomputation", int(popart.RecomputationType.Pipeline))
    opts._Popart.set("batchSerializationSettings.batchSchedule",
                     int(popart.BatchSerializationBatchSchedule.Isomorphic))
    assert opts.toDict()["_Popart"]["autoRecomputation"] == 3
    assert "_Popart.virtualGraphMode" in opts._ignored_options()
