"""PopTorch's compile-time rules for ``set_overlap_for_input`` / ``set_overlap_for_output``
(``_runtime/program/overlapped_io.py``, docs/ops.md).

Misplaced markers raise ``poptorch.Error`` at the first call, leaving the model as it was;
well-placed ones change nothing: every model is compared with the same model run by
plain PyTorch without markers (same seed, same data). Positive cases also run a
misplaced variant of the same model, which must raise.
"""
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

OVERLAP = poptorch.OverlapMode.OverlapAccumulationLoop
NONE = poptorch.OverlapMode.NoOverlap

NOT_INPUT = ("poptorch.set_overlap_for_input applied on a node which is not a tensor "
             "input to the model.")
NOT_OUTPUT = ("poptorch.set_overlap_for_output applied on a node which is not a tensor "
              "output to the model.")
TWICE = ("poptorch.set_overlap_for_output cannot be used with a tensor that is returned "
         "twice. Please check all returned tensors including those nested in tuples/lists.")


def only_op(n):
    return (f"poptorch.set_overlap_for_input must be the only op applied to an input. "
            f"This is not the case for input {n} to the model.")


def overlap_opts(**kw):
    """Options under which PopTorch allows overlapped IO."""
    opts = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.numIOTiles(32)
    opts.showCompilationProgressBar(False)
    for name, value in kw.items():
        getattr(opts, name)(value)
    return opts


def in_(x, mode=OVERLAP):
    return poptorch.set_overlap_for_input(x, mode)


def out(x, mode=OVERLAP):
    return poptorch.set_overlap_for_output(x, mode)


class Fn(nn.Module):
    """A model whose forward is ``fn(x)`` (no weights)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def raises(model, message, *inputs, opts=None):
    pm = poptorch.inferenceModel(model, opts or overlap_opts())
    with pytest.raises(poptorch.Error, match=re.escape(message)):
        pm(*inputs)
    assert not pm.isCompiled()
    return pm


# ------------------------------------------------------------------ rule 1
@pytest.mark.parametrize("fn", [
    lambda x: in_(x + 1),                      # on an intermediate tensor
    lambda x: (x + 1, in_(x + 1)),
    lambda x: in_(in_(x)),                     # on what a marker returned
    lambda x: in_(torch.ones(2)) + x,          # on a constant
], ids=["intermediate", "intermediate-returned", "marked-twice-nested", "constant"])
def test_input_marker_off_an_input_is_refused(fn):
    raises(Fn(fn), NOT_INPUT, torch.ones(2))


@pytest.mark.parametrize("marker, kind", [(in_, "inputs"), (out, "outputs")])
def test_markers_of_non_tensors_raise_poptorch_error(marker, kind):
    for value in ([torch.ones(1), "y"], {"a": 3}):
        with pytest.raises(poptorch.Error, match=re.escape(
                f"You may only set overlap for torch.tensor {kind}. ")) as info:
            marker(value)
        assert isinstance(info.value, TypeError)


def test_input_marker_error_comes_after_a_valid_one():
    def fn(x):
        x = in_(x)
        y = x + 1
        return y, in_(y)
    raises(Fn(fn), NOT_INPUT, torch.ones(2))


# ------------------------------------------------------------------ rule 2
@pytest.mark.parametrize("fn, also", [
    (lambda x: (x + 1, in_(x)), "add"),                       # used before marking
    (lambda x: (in_(x) * 2, x.exp()), "exp"),                 # used after marking
    (lambda x: in_(x) + in_(x), "second set_overlap"),        # marked twice
    (lambda x: (in_(x) + 1, x), "return"),                    # returned raw
    (lambda x: torch.cat([in_(x), x]), "cat"),                # raw inside a list arg
], ids=["before", "after", "twice", "returned", "in-list"])
def test_raw_input_used_by_another_op_is_refused(fn, also):
    pm = poptorch.inferenceModel(Fn(fn), overlap_opts())
    with pytest.raises(poptorch.Error, match=re.escape(only_op(0))) as info:
        pm(torch.ones(2))
    assert also in str(info.value) and "'x'" in str(info.value)


class Structured(nn.Module):
    def __init__(self, which):
        super().__init__()
        self.which = which

    def forward(self, a, pair, d):
        if self.which == "pair":
            t = in_(pair[1])
            return a + pair[0] + t + pair[1] + d["k"]
        if self.which == "dict":
            marked = in_(d)
            return a + pair[0] + pair[1] + marked["k"] + d["k"].sum()
        # well placed: every input marked, used only through the markers
        a, pair, d = in_(a), in_(pair), in_(d)
        return a + pair[0] * pair[1] - d["k"]


@pytest.mark.parametrize("which, n", [("pair", 2), ("dict", 3)])
def test_input_index_counts_tensors_in_nested_inputs(which, n):
    inputs = (torch.ones(2), (torch.ones(2), torch.ones(2)), {"k": torch.ones(2)})
    raises(Structured(which), only_op(n), *inputs)


def test_nested_inputs_marked_whole_match_plain_pytorch():
    torch.manual_seed(0)
    a, p0, p1, k = torch.randn(4, 3).unbind()
    pm = poptorch.inferenceModel(Structured("ok"), overlap_opts())
    for _ in range(2):
        assert torch.equal(pm(a, (p0, p1), {"k": k}), a + p0 * p1 - k)
    raises(Structured("pair"), only_op(2), a, (p0, p1), {"k": k})


def test_metadata_reads_of_a_raw_input_are_not_ops():
    def fn(x):
        rows, dims = x.shape[0], x.dim()
        assert x.dtype == torch.float32 and len(x) == rows and x.size(1) == 3
        x2 = in_(x)
        return x2.reshape(rows, -1).sum(dims - 1)
    x = torch.randn(2, 3)
    pm = poptorch.inferenceModel(Fn(fn), overlap_opts())
    assert torch.equal(pm(x), x.sum(1))
    raises(Fn(lambda x: in_(x) + x.sum()), only_op(0), x)


# ------------------------------------------------------------------ rule 3
@pytest.mark.parametrize("fn", [
    lambda x: (lambda x2: torch.mean(out(x2 + torch.ones_like(x2))))(in_(x)),  # reduced
    lambda x: (out(x * 2), x * 3)[1],                          # result dropped
], ids=["reduced", "dropped"])
def test_output_marker_not_returned_is_refused(fn):
    raises(Fn(fn), NOT_OUTPUT, torch.ones(2))


def test_raw_tensor_returned_instead_of_marked_one_is_refused():
    def fn(x):
        y = x + 1
        out(y)
        return y
    raises(Fn(fn), NOT_OUTPUT, torch.ones(2))


# ------------------------------------------------------------------ rule 4
@pytest.mark.parametrize("fn", [
    lambda x: (lambda y: (y, out(y)))(x + 1),                 # marked and raw
    lambda x: (lambda y: (y, [1, (y,)]))(out(x + 1)),         # nested tuple / list
    lambda x: (lambda y: [y, y])(out(x + 1)),
], ids=["raw-and-marked", "nested", "list"])
def test_marked_output_returned_twice_is_refused(fn):
    raises(Fn(fn), TWICE, torch.ones(2))


@pytest.mark.parametrize("reuse", ["before", "after"])
def test_marked_output_used_by_other_ops_matches_plain_pytorch(reuse):
    def fn(x, marked=True):
        y = x + 1
        if reuse == "before":
            z = y * 3
            y2 = out(y) if marked else y
        else:
            y2 = out(y) if marked else y
            z = y2 * 3
        return y2, z
    x = torch.randn(5)
    pm = poptorch.inferenceModel(Fn(fn), overlap_opts())
    got, want = pm(x), fn(x, marked=False)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=False))
    raises(Fn(lambda x: (lambda r: r + (r[0],))(fn(x))), TWICE, x)


# ------------------------------------------------------------------ rule 5 (options)
def test_overlap_needs_the_options_of_overlapped_io():
    def fn(x):
        return in_(x) + 1
    x = torch.ones(2)
    raises(Fn(fn), "Overlapped IO is not supported with poptorch.PipelinedExecution. "
           "If you are using only one IPU, please switch to poptorch.ShardedExecution.",
           x, opts=poptorch.Options())
    sharded = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    raises(Fn(fn), "No IO tiles allocated. You must allocate at least 32 IO tiles "
           "using poptorch.Options().TensorLocations.numIOTiles.", x, opts=sharded)
    assert torch.equal(poptorch.inferenceModel(Fn(fn), overlap_opts())(x), x + 1)
    # NoOverlap asks for nothing: any options, but the placement rules still hold
    no_overlap = poptorch.inferenceModel(Fn(lambda x: out(in_(x, NONE) + 1, NONE)))
    assert torch.equal(no_overlap(x), x + 1)
    raises(Fn(lambda x: out(x + 1, NONE) * 2), NOT_OUTPUT, x, opts=poptorch.Options())


# ------------------------------------------------------------------ whole models
class Net(nn.Module):
    """Two Linear layers on two IPUs (Blocks) with BatchNorm; markers when ``marked``,
    and a raw use of ``x`` after marking it when ``flags["bad"]`` (a dict: the wrapper's
    shallow copy of the module shares it)."""

    def __init__(self, marked=True):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)
        self.marked = marked
        self.flags = {"bad": False}

    def forward(self, x, labels):
        with poptorch.Block(ipu_id=0):
            x2 = in_(x) if self.marked else x
            h = F.relu(self.bn(self.fc1(x2)))
            if self.flags["bad"]:
                h = h + x.sum()
        with poptorch.Block(ipu_id=1):
            logits = self.fc2(h)
            loss = F.cross_entropy(logits, labels)
        if self.marked:
            logits, loss = out(logits), out(loss)
        return logits, loss


def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g))
            for _ in range(n)]


def test_training_matches_plain_pytorch_after_a_refused_first_call():
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    reference.marked = False
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    pm = poptorch.trainingModel(model, overlap_opts(outputMode=poptorch.OutputMode.All),
                                optimizer)
    data = _data(1, 3)
    model.flags["bad"] = True
    with pytest.raises(poptorch.Error, match=r"not the case for input 0 to the model"):
        pm(*data[0])
    assert not pm.isCompiled() and not optimizer.state_dict()["state"]
    for k, v in model.state_dict().items():  # weights and BatchNorm statistics
        assert torch.equal(v, before[k]), k
    model.flags["bad"] = False  # fixed: the same wrapper compiles and trains
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference.train()
    for x, labels in data:
        logits, loss = pm(x, labels)
        ref_opt.zero_grad()
        want_logits, want_loss = reference(x, labels)
        want_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    for (name, got), want in zip(pm.model.state_dict().items(),
                                 reference.state_dict().values(), strict=False):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_training_needs_output_mode_all_or_sum():
    model = Net()
    pm = poptorch.trainingModel(model, overlap_opts())  # default output mode: Final
    with pytest.raises(poptorch.Error, match="Unsupported output mode for overlapped IO"):
        pm(*_data(2, 1)[0])
    summed = poptorch.trainingModel(
        copy.deepcopy(model), overlap_opts(outputMode=poptorch.OutputMode.Sum))
    summed(*_data(2, 1)[0])


def test_inference_with_device_iterations_matches_plain_pytorch():
    torch.manual_seed(3)
    model = Net().eval()
    reference = copy.deepcopy(model)
    reference.marked = False
    (x, labels), = _data(4, 1)
    x, labels = torch.cat([x, x * 2]), torch.cat([labels, labels])
    pm = poptorch.inferenceModel(model, overlap_opts(deviceIterations=2))
    for _ in range(2):
        logits, loss = pm(x, labels)
        with torch.no_grad():
            want = [reference(x[i:i + 4], labels[i:i + 4]) for i in (0, 4)]
        assert torch.equal(logits, torch.cat([w[0] for w in want]))
        assert torch.equal(loss, torch.stack([w[1] for w in want]))
    model.flags["bad"] = True
    raises(copy.deepcopy(model), only_op(0), x, labels, opts=overlap_opts(deviceIterations=2))


def test_overlap_of_tuples_matches_plain_pytorch():
    def fn(xs, marked=True):
        xs = in_(xs) if marked else xs
        x = torch.cat(xs) + 1
        xs = x.chunk(2)
        return out(xs) if marked else xs

    class Model(nn.Module):
        def forward(self, xs):
            return fn(xs)
    xs = torch.arange(8.).reshape(4, 2).chunk(2)
    got, want = poptorch.inferenceModel(Model(), overlap_opts())(xs), fn(xs, False)
    assert isinstance(got, tuple) and all(torch.equal(g, w) for g, w in zip(got, want, strict=False))
    raises(Fn(lambda xs: (fn(xs), xs[0] + 1)), only_op(0), xs)


# ------------------------------------------------------------------ when checked
def test_checked_at_the_first_run_only():
    flags = {"bad": False}

    def fn(x):
        y = in_(x) * 2
        return (y + x) if flags["bad"] else y
    pm = poptorch.inferenceModel(Fn(fn), overlap_opts())
    x = torch.randn(3)
    assert torch.equal(pm(x), x * 2)
    flags["bad"] = True  # not compiled again: the markers are not checked again
    assert torch.equal(pm(x), x * 3)
    pm.destroy()  # compiled again at the next call: checked again
    with pytest.raises(poptorch.Error, match=r"not the case for input 0 to the model"):
        pm(x)
    assert not pm.isCompiled()


def _train_after_refusals(model, compile_raises):
    """``model`` with a raw use of its marked input: refused (by compile() when
    ``compile_raises``, else by the first call after it) and by the next calls, with
    nothing changed; once fixed, the same wrapper trains like plain PyTorch."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    reference.marked = False
    model.flags["bad"] = True
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    pm = poptorch.trainingModel(model, overlap_opts(outputMode=poptorch.OutputMode.All),
                                optimizer)
    data = _data(5, 2)
    if compile_raises:
        with pytest.raises(poptorch.Error, match=r"not the case for input 0 to the model"):
            pm.compile(*data[0])
        assert not pm.isCompiled()
    else:
        pm.compile(*data[0])
    for _ in range(2):  # refused until fixed, with nothing changed
        with pytest.raises(poptorch.Error, match=r"not the case for input 0 to the model"):
            pm(*data[0])
        assert not optimizer.state_dict()["state"]
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
    model.flags["bad"] = False
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, labels in data:
        logits, loss = pm(x, labels)
        ref_opt.zero_grad()
        want_logits, want_loss = reference(x, labels)
        want_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    for (name, got), want in zip(pm.model.state_dict().items(),
                                 reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_compile_checks_a_captured_model():
    """A model captured as a graph (model parallelism) is checked on the graph when it
    compiles (as PopTorch checks at compile time), before anything runs."""
    _train_after_refusals(Net(), compile_raises=True)


class DataDependentNet(Net):
    """``Net`` with control flow on a tensor value: cannot be captured as a graph."""

    def forward(self, x, labels):
        logits, loss = super().forward(x, labels)
        if logits.sum() > float("inf"):  # never true, but decided on a tensor value
            loss = loss * 2
        return logits, loss


def test_compile_then_first_call_checks_a_model_that_is_not_captured():
    """A model that cannot be captured is checked on the first forward of the first
    call after compile(); refused calls change nothing."""
    _train_after_refusals(DataDependentNet(), compile_raises=False)


class UnblockedDataDependentNet(Net):
    """``DataDependentNet`` without Blocks: under ShardedExecution it runs on one IPU,
    by the plain runner, which checks the markers on its first forward."""

    def forward(self, x, labels):
        x2 = in_(x) if self.marked else x
        h = F.relu(self.bn(self.fc1(x2)))
        if self.flags["bad"]:
            h = h + x.sum()
        logits = self.fc2(h)
        if logits.sum() > float("inf"):  # never true, but decided on a tensor value
            logits = logits * 2
        loss = F.cross_entropy(logits, labels)
        if self.marked:
            logits, loss = out(logits), out(loss)
        return logits, loss


def test_first_call_checks_a_model_on_one_ipu_that_is_not_captured():
    """The plain runner of a one-IPU model that cannot be captured checks the markers
    on the first forward, in training (then trains like plain PyTorch) and in
    inference."""
    _train_after_refusals(UnblockedDataDependentNet(), compile_raises=False)
    model = UnblockedDataDependentNet().eval()
    model.flags["bad"] = True
    raises(model, only_op(0), *_data(6, 1)[0])


@pytest.mark.parametrize("opts", ["compiled", "checked", "sharded"])
def test_compiled_backend_checks_the_first_call(monkeypatch, opts):
    """The inductor backend (traced with aot_eager here) runs the first call eagerly,
    checked, then the compiled pieces, also with floating-point checks after every
    step ("checked") and with sharded execution's options ("sharded")."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    mode = OVERLAP if opts == "sharded" else NONE

    def fn(x, bad=False):
        y = torch.sin(in_(x, mode)) * 2
        return out(y + x if bad else y, mode)

    def make(bad):
        o = overlap_opts() if opts == "sharded" else poptorch.Options()
        o.Jit.backend("inductor")
        o.Precision.enableFloatingPointExceptions(opts == "checked")
        return poptorch.inferenceModel(Fn(lambda x: fn(x, bad)), o)
    x = torch.randn(6)
    pm = make(False)
    for _ in range(3):
        assert torch.equal(pm(x), torch.sin(x) * 2)
    if opts == "sharded":  # an execution strategy: the eager backend's runner
        assert pm.backendInUse == "eager"
    else:
        assert pm.backendInUse == "compiling" and pm._program.selector.compiled is not None
    with pytest.raises(poptorch.Error, match=re.escape(only_op(0))):
        make(True)(x)
