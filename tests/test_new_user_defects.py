"""What a new user hits first (issue 22): each behaviour against plain PyTorch (same seed,
same data) or against the documented rule.

1. namedtuple outputs stay namedtuples; 2. a constant refused by setOptimizer is never
used; 3. a prediction is never a loss, whatever the micro-batch size; 4. a trainingModel
trains under torch.no_grad() / inference_mode(); 5. a call that fails part-way changes
nothing; 6. an inner identity_loss returned beside the final loss is part of it;
7. POPTORCH_BACKEND=auto; 8. setLogLevel("OFF") silences poptorch.optim; 9. the
power-of-two rule counts replicas; 10. the docs (migration.md, the wide tables' CSS).
"""
import collections
import copy
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch import _devices

ROOT = Path(__file__).resolve().parent.parent
Out = collections.namedtuple("Out", "y loss")


def _data(rows, seed=0, features=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=g), torch.randn(rows, 2, generator=g)


class Net(torch.nn.Module):
    def __init__(self, out=2, bn=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, out)
        self.bn = torch.nn.BatchNorm1d(3) if bn else None

    def forward(self, x, t=None):
        if self.bn is not None:
            x = self.bn(x)
        y = self.fc(x)
        if t is None:
            return y
        return y, F.mse_loss(y, t)


def _assert_same_params(a, b, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=False):
        assert torch.allclose(p, q, atol=atol), name


# -- 1. namedtuple outputs --------------------------------------------------------------
class NamedOut(Net):
    def forward(self, x, t):
        y = self.fc(x)
        return Out(y, F.mse_loss(y, t))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("d", [1, 2])
def test_namedtuple_output_keeps_its_type(training, d):
    model = NamedOut()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(d)
    wrap = poptorch.trainingModel if training else poptorch.inferenceModel
    pop = wrap(model, opts)
    for step in range(3):  # the compiling call, the general path, the fast path
        x, t = _data(2 * d, seed=step)
        out = pop(x, t)
        assert type(out) is Out
        if not training:
            expected = ref(x, t)
            assert torch.allclose(out.y, expected.y, atol=1e-6)
            assert torch.allclose(out.loss, torch.stack(
                [ref(x[i:i + 2], t[i:i + 2]).loss for i in range(0, 2 * d, 2)]).squeeze()
                if d > 1 else expected.loss, atol=1e-6)
    if training:
        assert out.loss.dim() == 0


# -- 2. setOptimizer refusing a constant ------------------------------------------------
@pytest.mark.parametrize("kind", ["poptorch", "torch"])
def test_refused_constant_change_is_never_used(kind):
    model = Net()
    ref = copy.deepcopy(model)
    if kind == "poptorch":
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)  # momentum: constant
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum at default
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pop = poptorch.trainingModel(model, optimizer=optimizer)

    def ref_step(x, t):
        ref_opt.zero_grad()
        ref(x, t)[1].backward()
        ref_opt.step()

    pop(*_data(4, seed=0))
    ref_step(*_data(4, seed=0))
    optimizer.param_groups[0]["momentum"] = 0.9
    with pytest.raises(poptorch.Error, match="'momentum' is constant"):
        pop.setOptimizer(optimizer)
    assert optimizer.param_groups[0]["momentum"] == 0.0  # the compiled value again
    for step in range(1, 4):
        pop(*_data(4, seed=step))
        ref_step(*_data(4, seed=step))
    _assert_same_params(model, ref)


# -- 3. no loss, whatever the micro-batch size -------------------------------------------
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("returns", ["tensor", "tuple"])
def test_a_prediction_is_never_taken_for_the_loss(rows, returns):
    class Forgot(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, x):
            y = self.fc(x)
            return y if returns == "tensor" else (y, y.detach() * 2)

    model = Forgot()
    before = copy.deepcopy(model)
    pop = poptorch.trainingModel(model)
    with pytest.raises(poptorch.Error, match="Couldn't find a loss"):
        pop(torch.randn(rows, 3))
    _assert_same_params(model, before, atol=0)


# -- 4. trainingModel under no_grad / inference_mode -----------------------------------
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_training_model_trains_whatever_the_host_grad_mode(mode):
    model = Net()
    ref = copy.deepcopy(model)
    pop = poptorch.trainingModel(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):  # compiling call, general path, fast path
        x, t = _data(4, seed=step)
        with mode():
            x, t = x.clone(), t.clone()  # inference tensors under inference_mode
            _, loss = pop(x, t)
        ref_opt.zero_grad()
        _, ref_loss = ref(*_data(4, seed=step))
        ref_loss.backward()
        ref_opt.step()
        assert torch.allclose(loss, ref_loss.detach(), atol=1e-6)
        assert torch.is_grad_enabled()
    _assert_same_params(model, ref)


# -- 5. a failing call changes nothing ---------------------------------------------------
class FailsOnMarker(torch.nn.Module):
    """BatchNorm (buffers), dropout (random stream) and a forward that raises on a row
    whose first feature is 1000."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bn = torch.nn.BatchNorm1d(3)
        self.fc = torch.nn.Linear(3, 2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, t):
        h = self.bn(x)
        if bool((x[:, 0] == 1000).any()):
            raise ValueError("bad row")
        y = self.drop(self.fc(h))
        return y, F.mse_loss(y, t)


def _state(pop, optimizer):
    tensors = {k: v.clone() for k, v in pop.model.state_dict().items()}
    opt = copy.deepcopy(optimizer.state_dict())
    return tensors, opt, pop.rng_state[1].clone()


def _assert_same_state(a, b):
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    sa, sb = a[1]["state"], b[1]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name]))
    assert torch.equal(a[2], b[2])


@pytest.mark.parametrize("d,g,fail_at", [(4, 1, 2), (1, 3, 1), (1, 1, 0)])
def test_a_call_failing_part_way_is_rolled_back(d, g, fail_at):
    model = FailsOnMarker()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    opts = poptorch.Options().deviceIterations(d).randomSeed(5)
    opts.Training.gradientAccumulation(g)
    pop = poptorch.trainingModel(model, opts, optimizer=optimizer)
    rows = 2 * d * g
    for step in range(3):  # compiled; the fast path is built where it can be (d=g=1)
        pop(*_data(rows, seed=step))
    before = _state(pop, optimizer)
    x, t = _data(rows, seed=9)
    x[2 * fail_at, 0] = 1000  # micro-batch ``fail_at`` of the call raises
    with pytest.raises(ValueError, match="bad row"):
        pop(x, t)
    _assert_same_state(before, _state(pop, optimizer))
    # ... and the next call goes on as if the failed one never happened
    twin = FailsOnMarker()
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    twin_pop = poptorch.trainingModel(twin, opts.clone(), optimizer=twin_opt)
    for step in range(3):
        twin_pop(*_data(rows, seed=step))
    out, twin_out = pop(*_data(rows, seed=7)), twin_pop(*_data(rows, seed=7))
    assert torch.equal(out[1], twin_out[1])
    _assert_same_state(_state(pop, optimizer), _state(twin_pop, twin_opt))


def test_a_failing_call_without_random_seed_restores_weights_against_plain_pytorch():
    """d=4: the reference is plain PyTorch's loop over the calls that succeed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)

    class Guarded(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, t):
            if bool((x[:, 0] == 1000).any()):
                raise ValueError("bad row")
            return F.mse_loss(self.inner(x), t)

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    pop = poptorch.trainingModel(Guarded(model), poptorch.Options().deviceIterations(4),
                                 optimizer=opt)
    for step in range(3):
        x, t = _data(8, seed=step)
        if step == 1:
            x[5, 0] = 1000  # device iteration 3 of 4
            with pytest.raises(ValueError):
                pop(x, t)
            continue
        pop(x, t)
        for i in range(4):
            ref_opt.zero_grad()
            F.mse_loss(ref(x[2 * i:2 * i + 2]), t[2 * i:2 * i + 2]).backward()
            ref_opt.step()
    _assert_same_params(model, ref)


# -- 6. an inner identity_loss returned beside the final loss ----------------------------
class InnerLoss(torch.nn.Module):
    def __init__(self, poptorch_losses):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 2)
        self.mark = poptorch_losses

    def forward(self, x):
        d = self.fc(x)
        if self.mark:
            inner = poptorch.identity_loss(d, "sum")
            loss = poptorch.identity_loss(0.1 * inner * inner + d * d, "mean")
        else:
            inner = d.sum()
            loss = (0.1 * inner * inner + d * d).mean()
        return d, inner, loss


@pytest.mark.parametrize("d", [1, 2])
def test_inner_identity_loss_returned_beside_the_final_loss(d):
    model = InnerLoss(True)
    ref = InnerLoss(False)
    ref.load_state_dict(model.state_dict())
    pop = poptorch.trainingModel(model, poptorch.Options().deviceIterations(d),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(3):
        x, _ = _data(2 * d, seed=step)
        _, _, loss = pop(x)
        for i in range(d):
            ref_opt.zero_grad()
            _, _, ref_loss = ref(x[2 * i:2 * i + 2])
            ref_loss.backward()
            ref_opt.step()
        assert torch.allclose(loss.reshape(-1)[-1], ref_loss.detach(), atol=1e-5)
    _assert_same_params(model, ref, atol=1e-5)


# -- 7. POPTORCH_BACKEND=auto ------------------------------------------------------------
@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_poptorch_backend_auto_is_accepted(monkeypatch, value):
    monkeypatch.setenv("POPTORCH_BACKEND", value)
    assert poptorch.Options().Jit.backend_name is None  # automatic, as documented
    model = Net()
    pop = poptorch.inferenceModel(model)
    x, _ = _data(4)
    assert torch.allclose(pop(x), model(x), atol=1e-6)


# -- 8. setLogLevel("OFF") silences poptorch.optim ---------------------------------------
def _optim_warning():
    """A WARNING from poptorch.optim: a constant changed under
    relaxOptimizerAttributesChecks."""
    model = Net()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    pop = poptorch.trainingModel(model, poptorch.Options().relaxOptimizerAttributesChecks(),
                                 optimizer=optimizer)
    pop(*_data(2))
    pop.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))


@pytest.mark.parametrize("level,heard", [("OFF", False), ("WARN", True)])
def test_set_log_level_governs_poptorch_optim(level, heard, caplog):
    old = poptorch.logger.level
    poptorch.setLogLevel(level)
    try:
        with caplog.at_level(logging.NOTSET):
            poptorch.logger.setLevel(poptorch.logger.level)  # caplog leaves it as set
            caplog.clear()
            _optim_warning()
    finally:
        poptorch.logger.setLevel(old)
    optim = [r for r in caplog.records if "relaxOptimizerAttributesChecks" in r.getMessage()]
    assert bool(optim) == heard
    assert all(r.name == poptorch.logger.name for r in caplog.records
               if r.name.startswith("poptorch"))


def test_every_poptorch_logger_is_poptorch_logger():
    """One logger: no module of the package creates another one."""
    for path in (ROOT / "src" / "poptorch").rglob("*.py"):
        if path.name == "_logging.py":
            continue
        assert "getLogger(" not in path.read_text(), path


# -- 9. the power-of-two rule counts the replicas -----------------------------------------
@pytest.mark.parametrize("per_replica,replicas,ok", [
    (1, 3, False), (3, 1, False), (3, 2, False), (1, 2, True), (1, 4, True), (2, 2, True)])
def test_power_of_two_rule_counts_ipus_times_replicas(per_replica, replicas, ok):
    opts = poptorch.Options().replicationFactor(replicas)
    if ok:
        assert _devices.round_num_ipus(per_replica, False, replicas) == per_replica
    else:
        with pytest.raises(poptorch.Error, match=r"not a power of 2.*autoRoundNumIPUs"):
            _devices.acquire_devices(opts, per_replica)
        opts.autoRoundNumIPUs()
        count = len(_devices.acquire_devices(opts, per_replica))
        assert count >= per_replica and count & (count - 1) == 0


def test_one_ipu_times_three_replicas_is_refused_like_three_times_one():
    model = Net()
    x, _ = _data(3)
    with pytest.raises(poptorch.Error, match=r"3 replicas = 3 IPUs.*not a power of 2"):
        poptorch.inferenceModel(model, poptorch.Options().replicationFactor(3))(x)
    opts = poptorch.Options().replicationFactor(3).autoRoundNumIPUs()
    assert torch.allclose(poptorch.inferenceModel(model, opts)(x), model(x), atol=1e-6)


# -- 10. the docs ------------------------------------------------------------------------
def test_migration_guide_states_fixed_shapes_and_host_side_hyperparameters():
    text = (ROOT / "docs" / "migration.md").read_text()
    assert "any shape with `eager`" not in text
    assert re.search(r"Input shapes are fixed by the first call with every backend, "
                     r"`eager` included", text)
    assert "apply at the next call without\n  `setOptimizer`" in text


def test_eager_model_with_other_input_shapes_raises_as_the_guide_says():
    opts = poptorch.Options()
    opts.Jit.backend("eager")
    pop = poptorch.inferenceModel(Net(), opts)
    pop(torch.randn(4, 3))
    with pytest.raises(poptorch.Error, match="Shape mismatch"):
        pop(torch.randn(2, 3))


def test_host_side_lr_change_applies_without_set_optimizer_as_the_guide_says():
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pop = poptorch.trainingModel(model, optimizer=opt)
    for step in range(3):
        if step == 1:
            opt.param_groups[0]["lr"] = ref_opt.param_groups[0]["lr"] = 0.5
        pop(*_data(4, seed=step))
        ref_opt.zero_grad()
        ref(*_data(4, seed=step))[1].backward()
        ref_opt.step()
    _assert_same_params(model, ref)


def test_wide_tables_scroll_instead_of_being_cut_off():
    config = (ROOT / "mkdocs.yml").read_text()
    sheets = re.findall(r"^extra_css:\n((?:\s+- .+\n)+)", config, re.M)
    assert sheets, "mkdocs.yml: no extra_css"
    css = "".join((ROOT / "docs" / s.strip()[2:]).read_text()
                  for s in sheets[0].strip().splitlines())
    rule = re.search(r"table\s*\{([^}]*)\}", css)
    assert rule and "overflow-x: auto" in rule.group(1) and "display: block" in rule.group(1)


# -- attribute forwarding: an explicit rule -------------------------------------------
def test_attributes_the_executor_lacks_are_read_from_the_model():
    model = Net()
    model.threshold = 0.5
    model._private = "the model's"
    pop = poptorch.inferenceModel(model)
    # as PopTorch: read on the model, private names included
    assert pop.threshold == 0.5 and pop.fc is model.fc and pop._private == "the model's"
    x, _ = _data(2)
    assert torch.allclose(pop(x), model(x))
    for name in ("_optimzer", "_programm"):  # ours are all created up front
        with pytest.raises(AttributeError, match=name):
            getattr(pop, name)
