"""What one compile produces is one object (``_runtime/compilation.py``): the executor
holds it in ``_compiled``, creates no other state after ``_init_state``, and
``destroy()`` drops all of it, also what it changed on the user's modules. Every test
checks the results against plain PyTorch."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._runtime.compilation import Compilation


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y=None):
        out = self.fc2(torch.relu(self.fc1(x)))
        if y is None:
            return out
        return out, F.cross_entropy(out, y)


def _data(n=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_the_executor_holds_one_compilation_and_no_other_state():
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    pop = poptorch.trainingModel(model, poptorch.Options(),
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    names = set(vars(pop))
    x, y = _data()

    def ref_step():
        ref_opt.zero_grad()
        loss = reference(x, y)[1]
        loss.backward()
        ref_opt.step()
        return loss

    for _ in range(3):
        torch.testing.assert_close(pop(x, y)[1], ref_step())
    pop.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for group in ref_opt.param_groups:
        group["lr"] = 0.05
    pop.detachFromDevice()
    pop.attachToDevice()
    torch.testing.assert_close(pop(x, y)[1], ref_step())
    pop.copyWeightsToHost()
    pop.getPerfCounters()
    assert pop.compilationTime().total_seconds() > 0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)

    compiled = pop._compiled
    assert isinstance(compiled, Compilation)
    assert set(vars(pop)) == names  # nothing created outside _init_state
    assert compiled.program is pop._executable
    assert compiled.optimizer is not None
    assert compiled.optimizer.device.param_groups[0]["lr"] == 0.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.program = None  # what the compile produced is not rebound
    pop.destroy()
    assert pop._compiled is None and set(vars(pop)) == names
    # compiled again at the next call, from the weights trained so far
    torch.testing.assert_close(pop(x, y)[1], ref_step())


def test_destroy_undoes_the_casting_rules_on_the_users_modules():
    torch.manual_seed(0)
    model = Net().eval()
    model.fc1.autocast()
    x, _ = _data()
    pop = poptorch.inferenceModel(model)
    out = pop(x)
    assert out.dtype == torch.float16  # fc1 in float16, fc2 follows its activations
    torch.testing.assert_close(out.float(), model(x), rtol=1e-2, atol=1e-2)
    assert "forward" in vars(model.fc1)  # the compile wrapped the shared submodule
    pop.destroy()
    assert "forward" not in vars(model.fc1)
    with torch.no_grad():
        plain = F.linear(torch.relu(F.linear(x, model.fc1.weight, model.fc1.bias)),
                         model.fc2.weight, model.fc2.bias)
        assert torch.equal(model(x), plain)  # the user's module is plain PyTorch again
    torch.testing.assert_close(pop(x), out)  # and compiles again with the same rules


def test_a_failed_first_call_leaves_nothing_compiled():
    class Failing(Net):
        def forward(self, x, y=None):
            raise RuntimeError("broken forward")

    model = Failing().eval()
    model.fc1.autocast()
    before = [p.detach().clone() for p in model.parameters()]
    pop = poptorch.inferenceModel(model)
    with pytest.raises(RuntimeError, match="broken forward"):
        pop(_data()[0])
    assert pop._compiled is None and not pop.isCompiled()
    assert "forward" not in vars(model.fc1)
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


def test_precision_locations_and_processes_are_compiled_into_the_config():
    """What the precision policy, the casting rules, the tensor locations and the
    joining of processes read: the options as compiled, frozen."""
    from poptorch._runtime.config import DistributedConfig, RuntimeConfig

    opts = poptorch.Options().broadcastBuffers(False)
    opts.Precision.setPartialsType(torch.half)
    opts.Precision.enableStochasticRounding(True)
    opts.Precision.autocastEnabled(False)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    config = RuntimeConfig.of(opts)
    assert config.precision.partials_type == torch.half
    assert config.precision.stochastic_rounding and not config.precision.autocast_enabled
    assert config.precision.half_float_casting == poptorch.HalfFloatCastingBehavior.Default
    assert config.locations.optimizer["onChip"] is False and not config.locations.phased
    assert config.distributed == DistributedConfig(
        process_id=0, num_processes=1, broadcast_buffers=False, input_group_size=1,
        input_cgt=poptorch.CommGroupType.Consecutive, strategy_name=None,
        stages_on_processes=False)
    with pytest.raises(TypeError):
        config.locations.optimizer["onChip"] = True  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.precision.stochastic_rounding = False  # type: ignore[misc]
    phased = poptorch.Options()
    phased.setExecutionStrategy(poptorch.SerialPhasedExecution(
        poptorch.Phase("a"), poptorch.Phase("b")))
    config = RuntimeConfig.of(phased)
    assert config.locations.phased
    assert config.distributed.strategy_name == "SerialPhasedExecution"


def test_a_model_without_autocast_casts_nothing():
    """Precision.autocastEnabled(False), read from the config: the autocast switch of
    a layer has no effect, the result is plain float32 PyTorch."""
    torch.manual_seed(0)
    model = Net().eval()
    model.fc1.autocast()
    opts = poptorch.Options()
    opts.Precision.autocastEnabled(False)
    x, _ = _data()
    out = poptorch.inferenceModel(model, opts)(x)
    assert out.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
