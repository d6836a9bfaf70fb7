"""Property-based tests (hypothesis) of bad input: Options setters, config files, model
inputs and DataLoader arguments.

Every rejection must be a poptorch.Error, ConfigFileError, TypeError or ValueError whose
message names the argument (a model's own error on an input that plain PyTorch rejects
too passes through as torch raised it); nothing may crash or hang, and after a rejected
call the options, the model's weights and buffers and the optimizer state are bitwise
unchanged and the next valid call works.

Budget: a few examples each in CI; ``POPTORCH_HYPOTHESIS_PROFILE=long`` runs hundreds.
"""
import copy
import inspect
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poptorch
from poptorch import DataLoaderMode
from poptorch.errors import ConfigFileError

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=400, deadline=None,
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("POPTORCH_HYPOTHESIS_PROFILE", "ci"))

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::UserWarning")]

ALLOWED = (poptorch.Error, ConfigFileError, TypeError, ValueError)
GENERIC = {"set", "createOrSet", "update", "deleteIfExists", "exists", "toDict",
           "checkIsFrozen", "clone", "from_json", "loadFromFile", "defaultOutputMode"}

# -- values -----------------------------------------------------------------------------
enum_members = st.sampled_from([m for name in poptorch.enums.__all__
                                for m in getattr(poptorch.enums, name)
                                if isinstance(getattr(poptorch.enums, name), type)])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=8), enum_members,
                    st.sampled_from([torch.float16, torch.float32, torch.int64]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner),
    st.dictionaries(st.text(max_size=4), inner, max_size=2)), max_leaves=6)


def setters():
    """(sub-object name or None, setter name, parameter names) of every setter."""
    opts = poptorch.Options()
    found = []
    for owner_name in (None, "Training", "Precision", "TensorLocations", "Jit",
                       "Distributed", "_Popart"):
        owner = opts if owner_name is None else getattr(opts, owner_name)
        for name in dir(owner):
            method = getattr(owner, name)
            if name.startswith("_") or name in GENERIC or not callable(method) or \
                    isinstance(method, type) or name in ("Training", "Precision",
                                                         "TensorLocations", "Jit",
                                                         "Distributed"):
                continue
            params = list(inspect.signature(method).parameters)
            found.append((owner_name, name, params))
    return found


SETTERS = setters()
ALIASES = {"anchorMode": "outputMode",  # deprecated names report the current one
           "accumulationReductionType": "accumulationAndReplicationReductionType"}


def names_argument(message, *names):
    text = message.lower()
    return any(name and name.lower().lstrip("_") in text for name in names)


def snapshot(opts):
    return repr(opts.toDict())


# -- Options setters -------------------------------------------------------------------
@given(setter=st.sampled_from(SETTERS), args=st.lists(values, max_size=3))
def test_options_setters_reject_bad_values_cleanly(setter, args, tmp_path_factory):
    owner_name, name, params = setter
    os.chdir(tmp_path_factory.getbasetemp())  # setters taking paths stay in here
    opts = poptorch.Options()
    owner = opts if owner_name is None else getattr(opts, owner_name)
    before = snapshot(opts)
    try:
        getattr(owner, name)(*args)
    except ALLOWED as error:
        message = getattr(error, "message", str(error))
        assert names_argument(message, name, ALIASES.get(name), *params), (
            name, args, message)
        assert snapshot(opts) == before, (name, args)
    # the options still work: a valid setter call and a model built from them
    opts.deviceIterations(1)
    assert opts.device_iterations == 1


# -- config files ----------------------------------------------------------------------
def setter_line(setter, args):
    owner_name, name, _ = setter
    prefix = f"{owner_name}." if owner_name else ""
    return f"{prefix}{name}({', '.join(map(repr, args))})"


line = st.one_of(
    st.builds(setter_line, st.sampled_from(SETTERS),
              st.lists(st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6),
                                 st.floats(-1e3, 1e3), st.text(max_size=6)), max_size=2)),
    st.text(max_size=30).map(lambda t: t.replace("\n", " ").replace("\r", " ")),
    st.sampled_from(["", "# comment", "deviceIterations(", "import os", "__import__('os')",
                     "deviceIterations(4) + 1", "Training.nope(1)", "x = 1",
                     "outputMode(poptorch.OutputMode.All)", "Precision.setPartialsType("
                     "torch.float16)", "exec('1')", "deviceIterations(*[1])"]))


@given(lines=st.lists(line, min_size=1, max_size=6))
def test_config_files_fail_as_config_file_errors(lines, tmp_path_factory):
    os.chdir(tmp_path_factory.getbasetemp())
    path = tmp_path_factory.mktemp("config") / "options.conf"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    opts = poptorch.Options()
    try:
        opts.loadFromFile(str(path))
    except ConfigFileError as error:
        text = str(error)
        assert str(path) in text, text  # names the file and the line
        lineno = int(text.split(str(path) + ":")[1].split(":")[0])
        assert 1 <= lineno <= len(lines)
    except ALLOWED as error:  # a setter's own rejection must also come as the file's
        pytest.fail(f"{type(error).__name__} instead of ConfigFileError: {error}")
    opts.deviceIterations(1)


# -- model inputs ----------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.bn = torch.nn.BatchNorm1d(2)

    def forward(self, x, y):
        out = self.bn(self.fc(x))
        return out, torch.nn.functional.cross_entropy(out, y)


def valid_inputs(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)


tensors = st.builds(
    lambda shape, dtype: torch.zeros(shape, dtype=dtype),
    st.lists(st.integers(0, 5), max_size=3),
    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64,
                     torch.int32, torch.bool]))
leaves = st.one_of(tensors, st.none(), st.integers(-3, 3), st.floats(-2, 2),
                   st.text(max_size=3))
structures = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.tuples(inner, inner),
    st.dictionaries(st.sampled_from(["x", "y", "z"]), inner, max_size=2)), max_leaves=5)
bad_calls = st.tuples(st.lists(structures, max_size=3),
                      st.dictionaries(st.sampled_from(["x", "y", "z"]), structures,
                                      max_size=2))


def state_of(model, optimizer):
    tensors = dict(model.state_dict())
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"opt/{index}/{key}"] = value
    return {k: v.detach().clone() for k, v in tensors.items()}


def assert_same_state(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


class Pair:
    """A training model fed random calls and a twin fed only the calls it accepted: after
    each call their weights, buffers and optimizer state must be bitwise equal."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = Net()
        self.twin_model = copy.deepcopy(self.model)
        self.optimizer = poptorch.optim.SGD(self.model.parameters(), lr=0.1,
                                            momentum=0.9)
        self.twin_optimizer = poptorch.optim.SGD(self.twin_model.parameters(), lr=0.1,
                                                 momentum=0.9)
        self.fuzzed = poptorch.trainingModel(self.model, poptorch.Options(),
                                             optimizer=self.optimizer)
        self.twin = poptorch.trainingModel(self.twin_model, poptorch.Options(),
                                           optimizer=self.twin_optimizer)
        self.step = 0

    def state(self, twin=False):
        executor = self.twin if twin else self.fuzzed
        if executor.isCompiled():
            executor.copyWeightsToHost()
        return state_of(self.twin_model if twin else self.model,
                        self.twin_optimizer if twin else self.optimizer)

    def valid_step(self):
        self.step += 1
        x, y = valid_inputs(self.step)
        out, loss = self.fuzzed(x, y)
        twin_out, twin_loss = self.twin(x, y)
        assert torch.equal(out, twin_out) and torch.equal(loss, twin_loss)
        assert_same_state(self.state(), self.state(twin=True))


def torch_rejects(args, kwargs):
    """The exception type plain PyTorch raises for this call of the model (None if it
    accepts it)."""
    try:
        Net()(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the reference decides
        return type(error)
    return None


@pytest.mark.parametrize("compiled_first", [False, True])
@given(calls=st.lists(bad_calls, min_size=1, max_size=3))
def test_rejected_model_calls_change_nothing(compiled_first, calls):
    pair = Pair()
    if compiled_first:
        pair.valid_step()
    for args, kwargs in calls:
        before = pair.state()
        reference_error = torch_rejects(args, kwargs)
        try:
            pair.fuzzed(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - checked below
            if not isinstance(error, ALLOWED):
                assert reference_error is not None and isinstance(error,
                                                                   reference_error), (
                    f"{type(error).__name__} for {args!r} {kwargs!r}: {error}")
            assert_same_state(pair.state(), before)
        else:  # accepted (as a valid call would be): the twin takes the same step
            pair.twin(*args, **kwargs)
            assert_same_state(pair.state(), pair.state(twin=True))
            # Both are now compiled for these inputs, and a compiled model accepts only
            # its compiled signature (PopTorch's rule): compile again for valid ones.
            pair.fuzzed.destroy()
            pair.twin.destroy()
        pair.valid_step()  # the next valid call works, as if nothing had happened


# -- DataLoader arguments --------------------------------------------------------------
loader_args = st.fixed_dictionaries({}, optional={
    "batch_size": st.one_of(st.integers(-2, 40), st.none(), st.floats(0, 4),
                            st.text(max_size=2)),
    "shuffle": st.one_of(st.booleans(), st.none(), st.integers(0, 2)),
    "drop_last": st.one_of(st.booleans(), st.integers(0, 1)),
    "num_workers": st.one_of(st.integers(-2, 1), st.text(max_size=2)),
    "mode": st.one_of(st.sampled_from(list(DataLoaderMode)), st.integers(-1, 5),
                      st.text(max_size=3)),
    "rebatched_worker_size": st.one_of(st.none(), st.integers(-1, 40), st.floats(0, 3)),
    "async_options": st.one_of(st.none(), st.dictionaries(
        st.sampled_from(["buffer_size", "load_indefinitely", "early_preload",
                         "sharing_strategy", "miss_sleep_time_in_ms", "rebatched_size",
                         "bogus"]),
        st.one_of(st.integers(-2, 4), st.booleans(), st.none(), st.text(max_size=2)),
        max_size=3)),
    "persistent_workers": st.one_of(st.none(), st.booleans()),
    "auto_distributed_partitioning": st.booleans(),
})
options_factors = st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 2))


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter([(torch.tensor([i]),) for i in range(self.size)])


@given(kwargs=loader_args, factors=options_factors, iterable=st.booleans(),
       size=st.integers(0, 40))
def test_dataloader_arguments_are_checked(kwargs, factors, iterable, size):
    opts = poptorch.Options().deviceIterations(factors[0])
    opts.Training.gradientAccumulation(factors[1])
    opts.replicationFactor(factors[2])
    data = Stream(size) if iterable else torch.utils.data.TensorDataset(
        torch.arange(size))
    kwargs = dict(kwargs)
    if kwargs.get("async_options"):
        kwargs["async_options"].setdefault("sharing_strategy", poptorch.SharingStrategy.Fork)
    try:
        loader = poptorch.DataLoader(opts, data, **kwargs)
    except ALLOWED as error:
        message = getattr(error, "message", str(error))
        names = list(kwargs) + ["dataset", "data set", "combined batch", "sampler"]
        assert names_argument(message, *names), (kwargs, message)
        return
    # accepted: the batches are those of torch's own loader with the combined batch size
    combined = loader.combinedBatchSize
    batches = []
    try:
        for batch in loader:
            batches.append(batch[0].clone())
    finally:
        loader.terminate()
    if loader._mode == DataLoaderMode.AsyncRebatched and iterable:
        reference_batch = combined
    else:
        reference_batch = loader.batch_size
    reference = torch.utils.data.DataLoader(
        data, batch_size=reference_batch,
        drop_last=loader.drop_last if not iterable or loader.num_workers == 0
        else loader.drop_last)
    if not kwargs.get("shuffle") and not loader.num_workers:
        want = [b[0] for b in reference]
        if loader._mode == DataLoaderMode.AsyncRebatched and iterable and \
                loader.rebatched_drop_last:
            want = [b for b in want if len(b) == combined]
        assert [b.tolist() for b in batches] == [w.tolist() for w in want]
    else:
        assert sorted(i for b in batches for i in b.view(-1).tolist()) == sorted(
            i for b in reference for i in b[0].view(-1).tolist()) or loader.drop_last
