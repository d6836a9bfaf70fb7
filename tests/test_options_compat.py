"""Options rules PopTorch programs rely on: POPTORCH_DEFAULT_OPTIONS, enum names with
their class prefix, offline targets matching ipuHardwareVersion()."""
import torch

import poptorch


def test_default_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS",
                       '{"deviceIterations": 2, "connectionType": "ConnectionType.OnDemand",'
                       ' "Precision.enableFloatingPointExceptions": true}')
    opts = poptorch.Options()
    explicit = poptorch.Options()  # environment applies to every new object...
    monkeypatch.delenv("POPTORCH_DEFAULT_OPTIONS")
    plain = poptorch.Options()
    assert opts.device_iterations == 2
    assert opts.connection_type == poptorch.ConnectionType.OnDemand.value
    assert repr(opts) == repr(explicit) != repr(plain)
    plain.deviceIterations(2).connectionType(poptorch.ConnectionType.OnDemand)
    plain.Precision.enableFloatingPointExceptions(True)
    assert repr(plain) == repr(opts)  # ...as if the setters had been called
    # and the model runs with them: two device iterations of plain PyTorch
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))


def test_offline_target_accepts_this_machines_hardware_version():
    opts = poptorch.Options().useOfflineIpuTarget(poptorch.ipuHardwareVersion())
    assert opts.ipu_version == poptorch.ipuHardwareVersion()


def test_config_file_may_construct_execution_strategies(tmp_path):
    conf = tmp_path / "poptorch.conf"
    conf.write_text("deviceIterations(2)\n"
                    "setExecutionStrategy(poptorch.ShardedExecution())\n")
    opts = poptorch.Options()
    opts.loadFromFile(str(conf))
    assert isinstance(opts._execution_strategy, poptorch.ShardedExecution)
    conf.write_text('setExecutionStrategy(poptorch.SerialPhasedExecution('
                    'poptorch.Phase(poptorch.Stage("0")), '
                    'poptorch.Phase(poptorch.Stage("1"))))\n')
    phased = poptorch.Options()
    phased.loadFromFile(str(conf))
    assert isinstance(phased._execution_strategy, poptorch.SerialPhasedExecution)
    conf.write_text("setExecutionStrategy(__import__('os'))\n")
    try:
        poptorch.Options().loadFromFile(str(conf))
        raise AssertionError("expected ConfigFileError")
    except poptorch.ConfigFileError as exc:
        assert "cannot apply" in str(exc)
    # a sharded model with blocks gives plain PyTorch's result
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(),
                                torch.nn.Linear(3, 1))
    poptorch.BeginBlock(model[2], ipu_id=1)
    x = torch.randn(4, 3)
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))


def test_inference_model_refuses_gradient_accumulation_when_wrapped():
    import pytest
    model = torch.nn.Linear(3, 2)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match=r"gradientAccumulation to 1 .*deviceIterations to process .* pipelined"):
        poptorch.inferenceModel(model, opts)
    sharded = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    sharded.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match=r"inferenceModel\(\)\. \(It is 2"):
        poptorch.inferenceModel(model, sharded)
    fixed = opts.clone()
    fixed.Training.gradientAccumulation(1)
    x = torch.randn(2, 3)
    torch.testing.assert_close(poptorch.inferenceModel(model, fixed)(x), model(x))
