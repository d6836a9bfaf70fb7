"""poptorch ops, each checked against a plain-PyTorch reference computed here."""
import itertools
import logging
import math

import pytest
import torch

import poptorch
from poptorch.ops.print_tensor import format_tensor
from poptorch.ops.scopes import current_name_scope
from poptorch._runtime import context


# --- identity_loss --------------------------------------------------------------------------

@pytest.mark.parametrize("reduction, code, reference", [
    ("sum", 0, torch.sum), ("mean", 1, torch.mean), ("none", 2, lambda t: t)])
def test_identity_loss_reductions_and_marking(reduction, code, reference):
    x = torch.randn(4, 3)
    context.take_marked_losses()
    for how in (reduction, code, poptorch.ReductionType(code)):
        loss = poptorch.identity_loss(x, how)
        torch.testing.assert_close(loss, reference(x))
        marked = context.take_marked_losses()
        assert len(marked) == 1 and marked[0] is loss


def test_identity_loss_backward_matches_plain_reduction():
    x = torch.randn(5, requires_grad=True)
    poptorch.identity_loss(x * 3, "mean").backward()
    ref = torch.randn(5).copy_(x.detach()).requires_grad_()
    (ref * 3).mean().backward()
    torch.testing.assert_close(x.grad, ref.grad)
    context.take_marked_losses()


@pytest.mark.parametrize("bad", ["avg", 3, None, True])
def test_identity_loss_bad_reduction(bad):
    with pytest.raises(poptorch.Error, match="unsupported reduction"):
        poptorch.identity_loss(torch.ones(2), bad)
    with pytest.raises(TypeError):
        poptorch.identity_loss([1.0], "sum")


# --- ipu_print_tensor -----------------------------------------------------------------------

def test_print_tensor_forward_and_gradient(capsys):
    x = torch.tensor([[1.0, -2.5], [3.25, 4.0]], requires_grad=True)
    y = poptorch.ipu_print_tensor(x * 2, "summation")
    forward = capsys.readouterr().out
    assert forward == "summation: (( 2.0000, -5.0000),\n ( 6.5000,  8.0000))\n"
    torch.testing.assert_close(y, x * 2)
    (y * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    backward = capsys.readouterr().out
    assert backward == ("summation_gradient: ((1.0000, 2.0000),\n (3.0000, 4.0000))\n")
    torch.testing.assert_close(x.grad, torch.tensor([[2.0, 4.0], [6.0, 8.0]]))


def test_print_tensor_without_gradient_and_formats(capsys):
    x = torch.tensor([0.5, 1.0], requires_grad=True)
    y = poptorch.ipu_print_tensor(x, print_gradient=False, float_format="scientific",
                                  digits=2, separator="; ", open_bracket="[",
                                  close_bracket="]")
    y.sum().backward()
    assert capsys.readouterr().out == "[5.00e-01; 1.00e+00]\n"
    poptorch.ipu_print_tensor(torch.tensor([1, 22, 333]))
    assert capsys.readouterr().out == "(  1,  22, 333)\n"
    poptorch.ipu_print_tensor(torch.tensor([1.5, 22.0]), float_format="none")
    assert capsys.readouterr().out == "(1.5, 22)\n"


def test_print_tensor_summarises_and_wraps():
    values = torch.arange(2000).reshape(40, 50)
    text = format_tensor(values, summarise_threshold=1000, edge_items=2)
    rows = text.split("\n")
    assert rows[0] == "((   0,    1, ...,   48,   49),"
    assert rows[2] == " ...,"
    assert rows[-1] == " (1950, 1951, ..., 1998, 1999))"
    assert len(rows) == 5
    full = format_tensor(torch.arange(30), max_line_width=20, digits=0)
    lines = full.split("\n")
    assert all(len(line) <= 20 for line in lines) and len(lines) > 1
    numbers = [int(v) for v in full.replace("(", "").replace(")", "").replace("\n", "")
               .split(",")]
    assert numbers == list(range(30))
    assert format_tensor(torch.arange(30), max_line_width=0).count("\n") == 0


def test_print_tensor_bad_arguments():
    with pytest.raises(poptorch.Error, match="float_format"):
        poptorch.ipu_print_tensor(torch.ones(1), float_format="hex")
    with pytest.raises(poptorch.Error, match="edge_items"):
        poptorch.ipu_print_tensor(torch.ones(1), edge_items=-1)


# --- nop, dynamic slices --------------------------------------------------------------------

def test_nop_is_a_copy_with_identity_gradient():
    x = torch.randn(3, requires_grad=True)
    y = poptorch.nop(x)
    assert y.data_ptr() != x.data_ptr()
    torch.testing.assert_close(y, x)
    (y * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("dim, start, size, step", [(0, 1, 3, 1), (1, 2, 4, 2), (-1, 0, 5, 3)])
def test_dynamic_slice_matches_slicing(dim, start, size, step):
    x = torch.randn(6, 7, 5)
    index = [slice(None)] * 3
    index[dim] = slice(start, start + size, step)
    reference = x[tuple(index)]
    torch.testing.assert_close(poptorch.dynamic_slice(x, dim, start, size, step), reference)
    dynamic = poptorch.dynamic_slice(x, dim, torch.tensor(start), size, step)
    torch.testing.assert_close(dynamic, reference)


def test_dynamic_slice_gradient_and_errors():
    x = torch.randn(8, requires_grad=True)
    poptorch.dynamic_slice(x, 0, torch.tensor(2), 4, 1).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0., 0, 1, 1, 1, 1, 0, 0]))
    with pytest.raises(poptorch.Error, match="does not fit"):
        poptorch.dynamic_slice(x, 0, 6, 4, 1)
    with pytest.raises(poptorch.Error, match="size must be a constant int"):
        poptorch.dynamic_slice(x, 0, 0, torch.tensor(2), 1)
    with pytest.raises(poptorch.Error, match="dim=3"):
        poptorch.dynamic_slice(x, 3, 0, 2, 1)
    # A dynamic start past the end is clamped into range, as on the device.
    torch.testing.assert_close(poptorch.dynamic_slice(x, 0, torch.tensor(7), 4, 1), x[4:8])


def test_empty_or_reversed_dynamic_slices_are_refused_as_upstream():
    x, src = torch.randn(8), torch.randn(1)
    for op in (lambda size: poptorch.dynamic_slice(x, 0, torch.tensor(5), size, 1),
               lambda size: poptorch.dynamic_update(x, src, 0, torch.tensor(5), size)):
        with pytest.raises(poptorch.Error, match="The start and end of a slice must be "
                                                 "different"):
            op(0)  # end == start
        with pytest.raises(poptorch.Error, match="Taking a slice of a tensor with the end "
                                                 "less than the start is not supported"):
            op(-2)  # end < start
    # a size that does not divide the dimension works (upstream's IPU limit is relaxed)
    torch.testing.assert_close(poptorch.dynamic_slice(x, 0, torch.tensor(1), 7, 1), x[1:8])


@pytest.mark.parametrize("start", [2, torch.tensor(2)])
def test_dynamic_update_matches_slice_assignment(start):
    x = torch.randn(4, 6)
    src = torch.randn(4, 3)
    reference = x.clone()
    reference[:, 2:5] = src
    out = poptorch.dynamic_update(x, src, 1, start, 3)
    torch.testing.assert_close(out, reference)
    assert not torch.equal(out, x)  # the input is left unchanged
    with pytest.raises(poptorch.Error, match="expected"):
        poptorch.dynamic_update(x, torch.randn(4, 2), 1, start, 3)
    with pytest.raises(poptorch.Error, match=r"same dimensionality. \(2\) vs \(1\)"):
        poptorch.dynamic_update(x, torch.randn(3), 1, start, 3)
    with pytest.raises(poptorch.Error, match=r"same dtype. \(torch.float32 vs torch.int64\)"):
        poptorch.dynamic_update(x, torch.ones(4, 3, dtype=torch.long), 1, start, 3)


# --- serializedMatMul -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(poptorch.MatMulSerializationMode))
def test_serialized_matmul_matches_matmul(mode):
    lhs = torch.randn(2, 8, 12, requires_grad=True)
    rhs = torch.randn(12, 6, requires_grad=True)
    out = poptorch.serializedMatMul(lhs, rhs, mode, 2)
    ref_lhs, ref_rhs = lhs.detach().clone().requires_grad_(), rhs.detach().clone().requires_grad_()
    reference = torch.matmul(ref_lhs, ref_rhs)
    torch.testing.assert_close(out, reference)
    grad = torch.randn_like(reference)
    out.backward(grad)
    reference.backward(grad)
    torch.testing.assert_close(lhs.grad, ref_lhs.grad)
    torch.testing.assert_close(rhs.grad, ref_rhs.grad)


def test_serialized_matmul_keep_precision_sums_in_float32():
    lhs = (torch.randn(4, 64) * 8).half()
    rhs = (torch.randn(64, 4) * 8).half()
    mode = poptorch.MatMulSerializationMode.ReducingDim
    partials = [torch.matmul(a.float(), b.float()) for a, b in zip(lhs.split(16, 1),
                                                                    rhs.split(16, 0), strict=False)]
    wide = poptorch.serializedMatMul(lhs, rhs, mode, 4, keep_precision=True)
    assert wide.dtype == torch.float16
    torch.testing.assert_close(wide, sum(partials).half(), rtol=0, atol=0)
    # Without keep_precision the slices accumulate into the float16 output itself:
    # within float16 rounding of the exact sum.
    narrow = poptorch.serializedMatMul(lhs, rhs, mode, 4)
    assert narrow.dtype == torch.float16
    torch.testing.assert_close(narrow.float(), sum(partials), rtol=2e-3, atol=0.5)


def test_serialized_matmul_keep_precision_accumulates_rhs_gradient_in_float32():
    lhs, rhs = (torch.randn(64, 8) * 8).half(), (torch.randn(8, 4) * 8).half()
    grad = (torch.randn(64, 4) * 8).half()
    mode = poptorch.MatMulSerializationMode.InputChannels
    grads = {}
    for keep in (True, False):
        right = rhs.clone().requires_grad_()
        poptorch.serializedMatMul(lhs, right, mode, 4, keep_precision=keep).backward(grad)
        grads[keep] = right.grad
    reference = sum(a.float().t() @ g.float() for a, g in zip(lhs.split(16), grad.split(16), strict=False))
    torch.testing.assert_close(grads[True], reference.half(), rtol=0, atol=0)
    # half-precision accumulation really differs here, so the check above is meaningful
    assert not torch.equal(grads[False], reference.half())


def test_serialized_matmul_errors():
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    with pytest.raises(poptorch.Error, match="must divide"):
        poptorch.serializedMatMul(a, b, poptorch.MatMulSerializationMode.OutputChannels, 2)
    with pytest.raises(poptorch.Error, match="factor must be an int >= 1"):
        poptorch.serializedMatMul(a, b, poptorch.MatMulSerializationMode.InputChannels)
    with pytest.raises(poptorch.Error, match="MatMulSerializationMode"):
        poptorch.serializedMatMul(a, b, "reducing_dim", 2)


# --- hints ----------------------------------------------------------------------------------

def test_hint_ops_are_identities_that_record(caplog):
    from poptorch.ops.hints import recorded_hints
    x = torch.randn(3)
    before = recorded_hints().get("set_available_memory", {"calls": 0})["calls"]
    with caplog.at_level(logging.INFO, logger="poptorch::python"):
        assert poptorch.set_available_memory(x, 0.3) is x
        assert poptorch.set_available_memory(x, 0.4) is x
    hint = recorded_hints()["set_available_memory"]
    assert hint["calls"] == before + 2 and hint["last"] == 0.4
    structure = {"a": x, "b": [x, (x,)]}
    mode = poptorch.OverlapMode.OverlapDeviceIterationLoop
    assert poptorch.set_overlap_for_input(structure, mode) is structure
    assert poptorch.set_overlap_for_output(x, mode) is x
    assert recorded_hints()["set_overlap_for_output"]["last"] is mode
    with pytest.raises(poptorch.Error, match="between 0.0 and 1.0"):
        poptorch.set_available_memory(x, 1.5)
    with pytest.raises(poptorch.Error, match="OverlapMode"):
        poptorch.set_overlap_for_input(x, "no_overlap")
    with pytest.raises(TypeError, match="found a str"):
        poptorch.set_overlap_for_input([x, "y"], mode)


# --- control flow ---------------------------------------------------------------------------

def test_for_loop_matches_python_loop():
    a, b = torch.randn(3), torch.randn(3)

    def body(x, y):
        return x * 0.5 + y, y + 1

    out = poptorch.for_loop(4, body, [a, b])
    ra, rb = a, b
    for _ in range(4):
        ra, rb = body(ra, rb)
    assert isinstance(out, list)
    torch.testing.assert_close(out[0], ra)
    torch.testing.assert_close(out[1], rb)
    with pytest.raises(poptorch.Error, match="returned 1 outputs"):
        poptorch.for_loop(2, lambda x, y: x, [a, b])
    with pytest.raises(poptorch.Error, match="shape"):
        poptorch.for_loop(2, lambda x: torch.cat([x, x]), [a])
    with pytest.raises(poptorch.Error, match="inputs\\[1\\] must be a tensor"):
        poptorch.for_loop(2, body, [a, 1.0])
    with pytest.raises(ValueError, match="Object is not list"):
        poptorch.for_loop(2, lambda x: x, a)
    # inputs are passed by value: in-place updates stay inside the loop
    counter = torch.ones(2, dtype=torch.int32)

    def bump(y):
        y += 1
        return y

    out = poptorch.for_loop(3, bump, [counter])
    torch.testing.assert_close(counter, torch.ones(2, dtype=torch.int32))
    torch.testing.assert_close(out[0], torch.full((2,), 4, dtype=torch.int32))


@pytest.mark.parametrize("flag", [True, False])
def test_cond_runs_the_chosen_branch(flag):
    x, y = torch.randn(3), torch.randn(3)
    outer = torch.randn(3)

    def then_body(a):
        a.add_(1)  # inputs are copies: the caller's tensor must not change
        return a * outer

    def else_body(a, b):
        return a - b

    x_before = x.clone()
    out = poptorch.cond(torch.tensor(flag), then_body, [x], else_body, [x, y])
    reference = (x_before + 1) * outer if flag else x - y
    torch.testing.assert_close(out[0], reference)
    torch.testing.assert_close(x, x_before)
    with pytest.raises(poptorch.Error, match="one-element boolean"):
        poptorch.cond(torch.tensor([True, False]), then_body, [x], else_body, [x, y])


# --- fps / nearest --------------------------------------------------------------------------

def _fps_reference(points, ptr, ratio, first=None):
    out = []
    for s, e in zip(ptr, ptr[1:], strict=False):
        seg = points[s:e]
        count = math.ceil(ratio * (e - s))
        chosen = [0 if first is None else first]
        while len(chosen) < count:
            best, best_d = None, -1.0
            for i in range(len(seg)):
                d = min(float(((seg[i] - seg[j]) ** 2).sum()) for j in chosen)
                if d > best_d:
                    best, best_d = i, d
            chosen.append(best)
        out.extend(s + c for c in chosen)
    return out


@pytest.mark.parametrize("ratio", [0.5, 0.3, 1.0])
def test_fps_matches_brute_force(ratio):
    points = torch.randn(17, 3)
    ptr = [0, 7, 17]
    got = poptorch.fps(points, ptr, ratio)
    assert got.dtype == torch.long
    assert got.tolist() == _fps_reference(points, ptr, ratio)
    assert poptorch.fps(points, torch.tensor(ptr), ratio).tolist() == got.tolist()


def test_fps_random_start_and_errors():
    points = torch.randn(10, 2)
    torch.manual_seed(3)
    first = int(torch.randint(10, ()))
    torch.manual_seed(3)
    got = poptorch.fps(points, [0, 10], 0.5, random_start=True)
    assert got.tolist() == _fps_reference(points, [0, 10], 0.5, first=first)
    with pytest.raises(poptorch.Error, match="ratio"):
        poptorch.fps(points, [0, 10], 0.0)
    with pytest.raises(poptorch.Error, match="non-decreasing"):
        poptorch.fps(points, [0, 11], 0.5)


def test_nearest_matches_brute_force():
    x, y = torch.randn(9, 2), torch.randn(7, 2)
    batch_x = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    batch_y = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    got = poptorch.nearest(x, y, batch_x, batch_y)
    reference = []
    for i in range(9):
        candidates = [j for j in range(7) if batch_y[j] == batch_x[i]]
        reference.append(min(candidates, key=lambda j: float(((x[i] - y[j]) ** 2).sum())))
    assert got.tolist() == reference
    unbatched = [min(range(7), key=lambda j: float(((x[i] - y[j]) ** 2).sum()))
                 for i in range(9)]
    assert poptorch.nearest(x, y).tolist() == unbatched
    with pytest.raises(poptorch.Error, match="sorted"):
        poptorch.nearest(x, y, batch_x.flip(0), batch_y)
    with pytest.raises(poptorch.Error, match="none in y"):
        poptorch.nearest(x, y, batch_x + 1, batch_y)


# --- ctc_beam_search_decoder ----------------------------------------------------------------

def _ctc_brute_force(log_probs, blank):
    """Every alignment enumerated: {collapsed labels: log probability}."""
    totals = {}
    steps, classes = log_probs.shape
    for alignment in itertools.product(range(classes), repeat=steps):
        labels, previous = [], None
        for c in alignment:
            if c != blank and c != previous:
                labels.append(c)
            previous = c
        score = sum(float(log_probs[t, c]) for t, c in enumerate(alignment))
        key = tuple(labels)
        totals[key] = float(torch.logaddexp(torch.tensor(totals.get(key, -math.inf)),
                                            torch.tensor(score)))
    return sorted(totals.items(), key=lambda kv: -kv[1])


@pytest.mark.parametrize("blank", [0, 2])
def test_ctc_beam_search_matches_enumeration(blank):
    steps, batch, classes, top = 4, 2, 3, 3
    log_probs = torch.randn(steps, batch, classes).log_softmax(-1)
    lengths = torch.tensor([4, 3])
    probs, path_lengths, paths = poptorch.ctc_beam_search_decoder(
        log_probs, lengths, blank=blank, beam_width=100, top_paths=top)
    assert probs.shape == (batch, top) and paths.shape == (batch, top, steps)
    for b in range(batch):
        expected = _ctc_brute_force(log_probs[:int(lengths[b]), b], blank)[:top]
        for rank, (labels, score) in enumerate(expected):
            assert path_lengths[b, rank] == len(labels)
            assert paths[b, rank, :len(labels)].tolist() == list(labels)
            assert (paths[b, rank, len(labels):] == blank).all()
            assert probs[b, rank].item() == pytest.approx(score, abs=1e-5)


def test_ctc_beam_search_errors():
    log_probs = torch.randn(3, 1, 4).log_softmax(-1)
    with pytest.raises(poptorch.Error, match="lengths"):
        poptorch.ctc_beam_search_decoder(log_probs, torch.tensor([5]))
    with pytest.raises(poptorch.Error, match="blank=4"):
        poptorch.ctc_beam_search_decoder(log_probs, torch.tensor([3]), blank=4)
    with pytest.raises(poptorch.Error, match="top_paths"):
        poptorch.ctc_beam_search_decoder(log_probs, torch.tensor([3]), beam_width=2,
                                         top_paths=3)


# --- custom_op ------------------------------------------------------------------------------

@torch.library.custom_op("poptorch_test::scaled_pair", mutates_args=())
def _scaled_pair(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> list[torch.Tensor]:
    return [x * alpha + y, x - y]


def test_custom_op_calls_torch_library_op():
    x, y = torch.randn(3), torch.randn(3)
    out = poptorch.custom_op([x, y], "scaled_pair", "poptorch_test", 1, example_outputs=[x, x],
                             attributes={"alpha": 2.5})
    assert isinstance(out, list) and len(out) == 2
    torch.testing.assert_close(out[0], x * 2.5 + y)
    torch.testing.assert_close(out[1], x - y)
    # a dotted domain resolves to the namespace with underscores
    dotted = poptorch.custom_op((x, y), "scaled_pair", "poptorch.test", 1, [x, x])
    torch.testing.assert_close(dotted[0], x + y)
    attribute_id = "attr:" + str(poptorch.attributes_lists.index({"alpha": 2.5}))
    assert poptorch.accessAttributes(attribute_id) == {"alpha": 2.5}


def test_custom_op_errors():
    x = torch.randn(3)
    with pytest.raises(poptorch.Error, match="no operator .missing. in domain .nowhere.: nothing is registered"):
        poptorch.custom_op([x], "missing", "nowhere", 1, [x])
    with pytest.raises(poptorch.Error, match="returned 2 outputs"):
        poptorch.custom_op([x, x], "scaled_pair", "poptorch_test", 1, [x])
    with pytest.raises(poptorch.Error, match=r"output 1 .* has shape \(3,\), but "
                                             r"example_outputs\[1\] has shape \(2,\)"):
        poptorch.custom_op([x, x], "scaled_pair", "poptorch_test", 1, [x, x[:2]])
    with pytest.raises(poptorch.Error, match="only floats"):
        poptorch.custom_op([x, x], "scaled_pair", "poptorch_test", 1, [x, x],
                           attributes={"alpha": [1.0, 2]})
    with pytest.raises(poptorch.Error, match="accessAttributes"):
        poptorch.accessAttributes("nonsense")


# --- CPU, ids, scopes, module_repr ----------------------------------------------------------

def test_cpu_op_round_trip_through_host_buffers():
    calls = []

    def layer(a, b):
        calls.append(a.device)
        return a * 2 + b, a.sum()

    op = poptorch.CPU(layer, "MyCPUOp")
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    out, total = op(x, y)
    torch.testing.assert_close(out, x * 2 + y)
    torch.testing.assert_close(total, x.sum())
    assert op.in_shapes == [x.shape, y.shape] and op.out_shapes == [x.shape, torch.Size([])]
    buffers = [t.data_ptr() for t in op.inputs]
    out2, _ = op(y, x)
    torch.testing.assert_close(out2, y * 2 + x)
    assert [t.data_ptr() for t in op.inputs] == buffers  # persistent host buffers reused
    assert out2.data_ptr() != op.outputs[0].data_ptr()  # results are copies
    assert calls == [torch.device("cpu")] * 2
    single = poptorch.CPU(lambda a: a + 1, "Single")
    torch.testing.assert_close(single(x), x + 1)


def test_cpu_op_is_inference_only_inside_an_executor():
    op = poptorch.CPU(lambda a: a * 3, "Triple")
    x = torch.randn(3, requires_grad=True)
    op(x).sum().backward()  # a plain PyTorch run keeps autograd
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0))
    with context.running_on_ipu(), pytest.raises(poptorch.Error, match="inference"):
        op(x)


def test_get_ipu_tensor_id_is_stable_and_distinct():
    a, b = torch.ones(1), torch.ones(1)
    assert poptorch.getIpuTensorId(a) == poptorch.getIpuTensorId(a)
    assert poptorch.getIpuTensorId(a) != poptorch.getIpuTensorId(b)


def test_name_scope_nests_and_labels_profiler_ranges():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with poptorch.NameScope("outer"):
            with poptorch.NameScope("inner") as scope:
                assert scope.name == "inner"
                assert current_name_scope() == "outer/inner"
                torch.relu(torch.randn(4))
            assert current_name_scope() == "outer"
    assert current_name_scope() == ""
    names = {event.key for event in prof.key_averages()}
    assert {"outer", "outer/inner"} <= names


def test_multiconv_runs_convolutions_normally_and_checks_counts():
    conv_a, conv_b = torch.nn.Conv2d(2, 3, 3), torch.nn.Conv2d(2, 4, 1)
    x = torch.randn(1, 2, 5, 5)
    multi = (poptorch.MultiConv().availableMemoryProportions((0.2, 0.3))
             .partialsTypes(torch.float).planType(poptorch.MultiConvPlanType.Serial)
             .enableConvDithering(True).perConvReservedTiles(4).cycleBackOff(0.5))
    with multi:
        ya, yb = conv_a(x), conv_b(x)
    torch.testing.assert_close(ya, torch.nn.functional.conv2d(x, conv_a.weight, conv_a.bias))
    torch.testing.assert_close(yb, torch.nn.functional.conv2d(x, conv_b.weight, conv_b.bias))
    assert multi.num_convolutions == 2
    assert multi.settings["availableMemoryProportions"] == (0.2, 0.3)
    with pytest.raises(poptorch.Error, match="3 values were given but 2 convolutions"):
        with poptorch.MultiConv().availableMemoryProportions([0.1, 0.2, 0.3]):
            conv_a(x), conv_b(x)
    with pytest.raises(poptorch.Error, match="\\[0, 1\\)"):
        poptorch.MultiConv().availableMemoryProportions(1.0)
    with pytest.raises(poptorch.Error, match="MultiConvPlanType"):
        poptorch.MultiConv().planType("serial")


def test_multiconv_scope_rules_as_poptorch():
    conv = torch.nn.Conv2d(1, 2, 3)
    x = torch.randn(1, 1, 6, 6)
    with pytest.raises(poptorch.Error, match="Nested poptorch.MultiConv is not supported"):
        with poptorch.MultiConv():
            with poptorch.MultiConv():
                conv(x)
    with pytest.raises(poptorch.Error, match="Unexpected end_multi_conv"):
        with poptorch.MultiConv():
            torch.pow(x, 2)
    # the scope is usable again after both errors and computes plain convolutions
    with poptorch.MultiConv():
        y = conv(x)
    torch.testing.assert_close(y, torch.nn.functional.conv2d(x, conv.weight, conv.bias))
    # bad settings: poptorch.Error, and the exception types PopTorch raises for them
    with pytest.raises(ValueError, match="Invalid partials types"):
        poptorch.MultiConv().partialsTypes("half")
    with pytest.raises(poptorch.Error, match="Invalid partials types"):
        poptorch.MultiConv().partialsTypes([torch.float, "float"])
    with pytest.raises(AssertionError, match="Invalid plan type"):
        poptorch.MultiConv().planType("parallel")


def test_module_repr_and_print(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3),
                                torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(3, 1)))
    assert poptorch.module_repr(model) == repr(model)
    poptorch.BeginBlock(model[1][1], "head", ipu_id=1)
    expected = repr(model).replace("(1): Linear",
                                   "(1): BeginBlock(user_id='head', ipu_id=1) Linear")
    assert poptorch.module_repr(model) == expected
    poptorch.print(model)
    assert capsys.readouterr().out == expected + "\n"
    # the module itself is marked too, and the wrapped model prints the same way
    poptorch.BeginBlock(model[1], user_id=2, ipu_id=1)
    assert poptorch.module_repr(model[1]).startswith("BeginBlock(user_id=2, ipu_id=1) Seq")
    assert poptorch.module_repr(model) in repr(poptorch.inferenceModel(model))
    # copies keep the annotations
    import copy
    for clone in (copy.copy(model), copy.deepcopy(model)):
        assert poptorch.module_repr(clone) == poptorch.module_repr(model)
    poptorch.print("plain")
    assert capsys.readouterr().out == "plain\n"


def _add_one(x):
    return x + 1.0


def test_begin_block_wraps_a_function_legacy_use(tmp_path):
    block = poptorch.BeginBlock(_add_one, 1, 2)
    assert (block._user_id, block._ipu_id) == (1, 2)
    x = torch.randn(3)
    torch.testing.assert_close(block(x), x + 1.0)  # still the function outside a model
    torch.save(block, tmp_path / "block.pt")  # picklable, as in PopTorch


def test_ops_module_reexports_block_api():
    assert poptorch.ops.BeginBlock is poptorch.BeginBlock
    assert poptorch.ops.recomputationCheckpoint is poptorch.recomputationCheckpoint
    assert poptorch.ops.attributes_lists is poptorch.attributes_lists


# --- small utilities: compile hooks, at-exit cleanups, testing.allclose ---------------------

def test_compile_hooks_run_in_order_and_are_removable():
    from poptorch.executor import hooks as _hooks
    calls = []
    first = poptorch.registerPreCompileHook(lambda: calls.append("pre1"))
    second = poptorch.registerPreCompileHook(lambda: calls.append("pre2"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    _hooks.run_pre_compile_hooks()
    _hooks.run_post_compile_hooks()
    assert calls == ["pre1", "pre2", "post"]
    first.remove()
    post.remove()
    calls.clear()
    _hooks.run_pre_compile_hooks()
    _hooks.run_post_compile_hooks()
    assert calls == ["pre2"]
    second.remove()
    with pytest.raises(RuntimeError, match="callable"):
        poptorch.registerPreCompileHook("not a function")


def test_at_exit_runs_cleanups_once_newest_first(caplog, monkeypatch):
    from poptorch.executor import hooks as _hooks
    monkeypatch.setattr(_hooks, "_at_exit", [])  # leave the session's real cleanups alone
    calls = []
    _hooks.register_at_exit(lambda: calls.append("first"))
    _hooks.register_at_exit(lambda: 1 / 0)
    _hooks.register_at_exit(lambda: calls.append("last"))
    poptorch.poptorchAtExit()
    poptorch.poptorchAtExit()
    assert calls == ["last", "first"]
    assert "ZeroDivisionError" in caplog.text or "division by zero" in caplog.text


def test_testing_allclose_on_nested_structures():
    import poptorch.testing
    a = torch.randn(3)
    ref = {"out": (a, [torch.arange(3), 1.5]), "name": "x"}
    close = {"out": (a + 1e-7, [torch.arange(3), 1.5 + 1e-9]), "name": "x"}
    assert poptorch.testing.allclose(ref, close)
    assert poptorch.testing.allclose(a, a.half()) == torch.allclose(a, a.half().float(),
                                                                    rtol=1e-3, atol=1e-5)
    assert not poptorch.testing.allclose(ref, {"out": (a + 1e-2, [torch.arange(3), 1.5]),
                                               "name": "x"})
    assert not poptorch.testing.allclose(ref, {"out": [a, [torch.arange(3), 1.5]],
                                               "name": "x"})
    assert not poptorch.testing.allclose(torch.arange(3), torch.tensor([0, 1, 3]))
    assert not poptorch.testing.allclose(a, a[:2])
    nan = torch.tensor([float("nan"), 1.0])
    assert poptorch.testing.allclose(nan, nan.clone())


def test_cond_captures_as_torch_cond_under_compile():
    def model(flag, x, y):
        return poptorch.cond(flag, lambda a: a * 2, [x], lambda a, b: a - b, [x, y])[0] + 1

    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x, y = torch.randn(3), torch.randn(3)
    for flag in (True, False):
        torch.testing.assert_close(compiled(torch.tensor(flag), x, y),
                                   model(torch.tensor(flag), x, y))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_ops_keep_tensors_on_the_gpu():
    x = torch.randn(6, 4, device="cuda")
    sliced = poptorch.dynamic_slice(x, 0, torch.tensor(1, device="cuda"), 3, 1)
    assert sliced.is_cuda
    torch.testing.assert_close(sliced.cpu(), x.cpu()[1:4])
    op = poptorch.CPU(lambda a: a * 2, "Double")
    doubled = op(x)
    assert doubled.is_cuda and op.inputs[0].device.type == "cpu"
    torch.testing.assert_close(doubled, x * 2)
    assert poptorch.fps(x, [0, 6], 0.5).is_cuda
    assert poptorch.nearest(x, x[:3]).is_cuda
