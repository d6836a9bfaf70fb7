"""Rules adopted so that libraries built on PopTorch run unchanged (issue 17:
lightning-graphcore, optimum-graphcore), each checked against plain PyTorch.

The libraries themselves run in ``tests_integration/`` (opt-in, own environments).
"""
import collections
import copy
import pathlib
import sys

import pytest
import torch

import poptorch
from poptorch._runtime.weights import sync as weight_sync


class Recorder(torch.nn.Module):
    """A submodule that keeps state between calls and, like LightningModule, drops some
    of it when pickled/copied through ``__getstate__``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.owner = "trainer"
        self.calls = 0

    def __getstate__(self):
        state = dict(self.__dict__)
        state["owner"] = None
        return state

    def forward(self, x):
        if self.owner is None:
            raise RuntimeError("state lost by a copy")
        self.calls += 1
        return self.fc(x)


class Net(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.body = Recorder()
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, y):
        out = self.drop(self.body(x))
        return out, torch.nn.functional.mse_loss(out, y)


def _data(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


# -- model copy: the top module only, submodules shared ---------------------------------
def test_submodules_are_shared_with_the_users_module():
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(0)
    ref = Net()  # not deepcopy: that goes through __getstate__
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(step)
        out, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_out, ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
    assert pop._model.body is model.body  # no copy, so no __getstate__ side effects
    assert model.body.owner == "trainer" and model.body.calls == 3  # state is shared
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.allclose(p, q, atol=1e-6)


def test_each_wrapper_runs_in_its_own_mode_and_flags_come_back():
    torch.manual_seed(0)
    model = Net(dropout=0.5).eval()
    train = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    infer = poptorch.inferenceModel(model)
    x, y = _data(0, n=64)
    with torch.no_grad():
        expected_eval = model(x, y)[0]
    assert torch.equal(infer(x, y)[0], expected_eval)
    torch.manual_seed(5)
    out_train = train(x, y)[0]
    torch.manual_seed(5)
    model.train()
    expected_train = model(x, y)[0]
    model.eval()
    assert (out_train == 0).any()  # dropout was active in the training wrapper
    assert torch.allclose(out_train, expected_train.detach(), atol=1e-6)
    # every module has its own flag back: the user's module is still in eval mode
    assert not any(m.training for m in model.modules())
    model.train()
    assert torch.equal(infer(x, y)[0], expected_eval)  # inference stays in eval mode
    assert all(m.training for m in model.modules())


def test_executable_is_none_until_compiled_and_after_destroy():
    model = Net()
    pop = poptorch.inferenceModel(model)
    assert pop._executable is None
    pop(*_data(0))
    assert pop._executable is not None and pop.isCompiled()
    pop.destroy()
    assert pop._executable is None


def test_poplar_executor_at_upstreams_module_path():
    pop = poptorch.inferenceModel(Net())
    assert isinstance(pop, poptorch._poplar_executor.PoplarExecutor)
    assert poptorch._poplar_executor.PoplarExecutor is poptorch.PoplarExecutor


# -- the loss inside a dict-like output ------------------------------------------------
class DictOutput(collections.OrderedDict):
    """Like Hugging Face's ModelOutput: a dict with the loss under 'loss'."""


class DictNet(torch.nn.Module):
    def __init__(self, kind=dict):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.kind = kind

    def forward(self, x, y):
        logits = self.fc(x)
        return self.kind(logits=logits, loss=torch.nn.functional.mse_loss(logits, y))


@pytest.mark.parametrize("kind", [dict, DictOutput])
def test_loss_found_under_loss_key_of_a_mapping(kind):
    torch.manual_seed(0)
    model = DictNet(kind)
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(step)
        out = pop(x, y)
        ref_opt.zero_grad()
        ref_out = ref(x, y)
        ref_out["loss"].backward()
        ref_opt.step()
        assert isinstance(out, kind)
        assert torch.allclose(out["loss"], ref_out["loss"].detach(), atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.allclose(p, q, atol=1e-6)


class Fields(collections.OrderedDict):
    """A dataclass-style constructor (keyword arguments only), like ModelOutput's."""

    def __init__(self, *, logits=None, loss=None):
        super().__init__()
        if logits is not None:
            self["logits"] = logits
        if loss is not None:
            self["loss"] = loss


@pytest.mark.parametrize("kind", [DictOutput, Fields])
def test_dict_like_outputs_are_gathered_key_by_key(kind):
    # an unregistered Mapping subclass is one opaque pytree leaf: the outputs of the
    # device iterations must still be concatenated entry by entry, as for a dict
    torch.manual_seed(0)
    model = DictNet(kind)
    pop = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(3))
    x, y = _data(0, n=6)
    out = pop(x, y)
    with torch.no_grad():
        parts = [model(x[i:i + 2], y[i:i + 2]) for i in range(0, 6, 2)]
    assert type(out) is kind and list(out.keys()) == ["logits", "loss"]
    assert torch.equal(out["logits"], torch.cat([p["logits"] for p in parts]))
    assert torch.equal(out["loss"], torch.stack([p["loss"] for p in parts]))


def test_mapping_without_a_loss_is_a_clear_error():
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return {"logits": self.fc(x)}

    pop = poptorch.trainingModel(NoLoss())
    with pytest.raises(poptorch.Error, match=r"keys \['logits'\].*'loss'"):
        pop(torch.randn(2, 4))


class LossFirst(torch.nn.Module):
    """Hugging Face's tuple convention: (loss, logits) when labels are given."""

    def __init__(self, outputs=2):
        super().__init__()
        self.fc = torch.nn.Linear(4, outputs)

    def forward(self, x, y):
        out = self.fc(x)
        return torch.nn.functional.mse_loss(out, y), out


@pytest.mark.parametrize("rows,outputs", [(4, 2), (1, 1)])
def test_loss_first_in_a_tuple_when_the_last_element_is_not_a_0dim_tensor(rows, outputs):
    # (1, 1): the logits of a single row are a one-element tensor too; the 0-dim loss wins
    torch.manual_seed(0)
    model = LossFirst(outputs)
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(step, n=rows)
        y = y[:, :outputs]
        loss, _ = pop(x, y)
        ref_opt.zero_grad()
        ref_loss, _ = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.allclose(p, q, atol=1e-6)


# -- pipelining only across several IPUs ------------------------------------------------
class Blocks(torch.nn.Module):
    def __init__(self, ipus):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in ipus)
        for layer, ipu in zip(self.layers, ipus, strict=False):
            poptorch.BeginBlock(layer, ipu_id=ipu)

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, ((x - y) ** 2).mean()


def test_stages_on_one_ipu_are_not_pipelined():
    # AutoIncrement: one stage per block, all on IPU 0, gradientAccumulation(1): upstream
    # does not pipeline a single-IPU model, so no pipeline-depth rule applies
    torch.manual_seed(0)
    model = Blocks([0, 0, 0])
    ref = copy.deepcopy(model)
    poptorch.removeBlocks(ref)
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    pop = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _step in range(2):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        pop(x, y)
        ref_opt.zero_grad()
        ref(x, y)[1].backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.allclose(p, q, atol=1e-6)
    # across two IPUs the same options are a pipeline, whose depth rule still applies
    two = poptorch.trainingModel(Blocks([0, 1, 1]), opts.clone())
    with pytest.raises(poptorch.Error, match="gradientAccumulation.*pipeline stages"):
        two(torch.randn(3, 4), torch.randn(3, 4))


# -- poptorch._impl ---------------------------------------------------------------------
def test_is_dispatch_tracing_is_false_so_forward_creates_tensors_as_pytorch_does():
    seen = []

    class Ones(torch.nn.Module):
        def forward(self, x):
            seen.append((poptorch.isRunningOnIpu(), poptorch._impl.isDispatchTracing()))
            device = "ipu" if poptorch._impl.isDispatchTracing() else None
            return torch.ones((2, 3), dtype=torch.float16, device=device) + x

    for dtype in (torch.float16, torch.float32):
        x = torch.tensor([1.5], dtype=dtype)
        expected = Ones()(x)
        out = poptorch.inferenceModel(Ones())(x)
        assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert not poptorch._impl.isDispatchTracing()
    assert (True, False) in seen


def test_unwrap_and_rewrap_are_no_ops_on_the_cpu():
    model = Net()
    pop = poptorch.trainingModel(model)
    pop(*_data(0))
    cls = type(model)
    assert not poptorch._impl.isWrapped(model)
    poptorch._impl.unwrapModelIfNecessary(model)
    poptorch._impl.rewrapModelIfNecessary(model)
    assert type(model) is cls


def test_unwrap_copies_newer_device_weights_and_rewrap_restores_the_wrapping():
    class FakeSync:  # stands in for an accelerator's WeightSync
        def __init__(self, host, value):
            self.host, self.value, self.copies, self.dirty = host, value, 0, True

        def to_host_if_needed(self):
            if not self.dirty:
                return
            self.dirty = False  # first, as WeightSync: reading the host must not recurse
            self.copies += 1
            with torch.no_grad():
                self.host.body.fc.weight.fill_(self.value)

    model = Net()
    sync = FakeSync(model, 3.0)
    weight_sync.install_access_hook(model, sync)
    hooked = type(model)
    assert poptorch._impl.isWrapped(model)
    poptorch._impl.unwrapModelIfNecessary(model)
    assert type(model) is Net and not poptorch._impl.isWrapped(model)
    assert torch.equal(model.body.fc.weight, torch.full((2, 4), 3.0))
    copies, sync.dirty = sync.copies, True
    _ = model.body.fc.weight  # a plain module now: reading copies nothing
    assert sync.copies == copies
    poptorch._impl.rewrapModelIfNecessary(model)
    assert type(model) is hooked and poptorch._impl.isWrapped(model)


# -- popart: the enums programs pass to Options._Popart ---------------------------------
def test_popart_compat_enums_pass_through_popart_options(monkeypatch):
    compat = pathlib.Path(__file__).resolve().parents[1] / "compat" / "popart" / "src"
    monkeypatch.syspath_prepend(str(compat))
    monkeypatch.delitem(sys.modules, "popart", raising=False)
    import popart
    assert pathlib.Path(popart.__file__).is_relative_to(compat)
    opts = poptorch.Options()
    opts._Popart.set("subgraphCopyingStrategy", int(popart.SubgraphCopyingStrategy.JustInTime))
    opts._Popart.set("accumulateOuterFragmentSettings.schedule",
                     int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized))
    assert opts.toDict()["_Popart"]["subgraphCopyingStrategy"] == 1
    assert opts.toDict()["_Popart"]["accumulateOuterFragmentSettings.schedule"] == 3
    with pytest.raises(AttributeError, match="popart.Builder is not available"):
        popart.Builder  # noqa: B018


# -- LAMB: max_weight_norm per param group ------------------------------------------------
def test_lamb_max_weight_norm_per_param_group():
    # optimum-graphcore gives the biases max_weight_norm=0.0 (phi = 0: trust ratio 1, the
    # plain Adam direction) and marks the attribute constant; upstream allows both
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-6
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    groups = [{"params": [p for n, p in model.named_parameters() if "bias" not in n]},
              {"params": [p for n, p in model.named_parameters() if "bias" in n],
               "max_weight_norm": 0.0, "weight_decay": 0.0}]
    opt = poptorch.optim.LAMB(groups, lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.01,
                              max_weight_norm=None)
    opt.variable_attrs.markAsConstant("max_weight_norm")
    params = list(ref.parameters())
    names = [n for n, _ in ref.named_parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for t in range(1, 4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for p in params:
            p.grad = None
        torch.nn.functional.mse_loss(ref(x), y).backward()
        with torch.no_grad():
            for i, (name, w) in enumerate(zip(names, params, strict=False)):
                bias = "bias" in name
                g = w.grad
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                r = (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** t)).sqrt() + eps)
                if not bias:
                    r = r + 0.01 * w
                phi = min(w.norm(), 0.0) if bias else w.norm()
                trust = phi / r.norm() if phi > 0 and r.norm() > 0 else 1.0
                w -= lr * trust * r
    for p, q in zip(model.parameters(), params, strict=False):
        assert torch.allclose(p, q, atol=1e-6)
    with pytest.raises(ValueError, match="max_weight_norm"):
        poptorch.optim.LAMB([{"params": params, "max_weight_norm": -1.0}])
