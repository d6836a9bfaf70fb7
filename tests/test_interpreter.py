"""The one-stage interpreter (``_runtime/program/interpreter.py``): its schedules as data
(every action after what it consumes) and its runs against plain-PyTorch loops."""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn

from poptorch._runtime.program.concurrent_replicas import ReplicaCopies
from poptorch._runtime.program.interpreter import EagerCompute, Interpreter
from poptorch._runtime.schedule.schedules import one_stage_schedule
from poptorch._runtime.program.runner import ReplicaBuffers
from poptorch._runtime.schedule.actions import Action, ActionKind

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
LOAD, STORE, DROP = ActionKind.LOAD, ActionKind.STORE, ActionKind.DROP
ALL_REDUCE, BROADCAST = ActionKind.ALL_REDUCE, ActionKind.BROADCAST


def _check_consumes(actions):
    """Every B after its F on the same lane; a lane's LOAD before its F and STORE after
    its B; an ALL_REDUCE right before the F it arms; DROP last."""
    seen = {}
    for i, a in enumerate(actions):
        seen[(a.kind, a.microbatch)] = i
        if a.kind is B:
            assert seen[(F, a.microbatch)] < i
        if a.kind is F and (LOAD, a.microbatch) in seen:
            assert seen[(LOAD, a.microbatch)] < i
        if a.kind is STORE:
            assert seen[(F, a.microbatch)] < i
            if (B, a.microbatch) in seen:
                assert seen[(B, a.microbatch)] < i
        if a.kind is ALL_REDUCE and a.microbatch >= 0:
            assert actions[i + 1] == Action(F, 0, a.microbatch, a.lane)
    if any(a.kind is DROP for a in actions):
        assert actions[-1].kind is DROP


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("replicas,per_step", [(1, 1), (1, 3), (2, 4), (3, 6)])
@pytest.mark.parametrize("states,broadcast,reduce_last,copies", [
    (False, False, False, False), (True, False, False, False), (True, True, True, False),
    (False, False, False, True), (False, True, False, True)])
def test_schedules_consume_in_order(training, replicas, per_step, states, broadcast,
                                    reduce_last, copies):
    count = 2 * per_step
    actions = one_stage_schedule(count, training, replicas, per_step, states, broadcast,
                                 reduce_last, copies)
    _check_consumes(actions)
    forwards = [a for a in actions if a.kind is F]
    assert [a.microbatch for a in forwards] == list(range(count))
    assert all(a.lane == a.microbatch % replicas for a in forwards)
    assert sum(a.kind is B for a in actions) == (count if training else 0)
    if reduce_last and training and not copies:
        armed = [a.microbatch for a in actions if a.kind is ALL_REDUCE]
        assert armed == [m for m in range(count) if (m + 1) % per_step == 0]
    if copies and training:  # the lanes' gradients summed once per step
        assert sum(a.kind is ALL_REDUCE for a in actions) == count // per_step


def test_a_schedule_that_reads_before_it_writes_is_caught():
    bad = [Action(B, 0, 0, 0), Action(F, 0, 0, 0)]
    with pytest.raises(KeyError):
        _check_consumes(bad)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.fc(x))


class LossOf:
    multiplier = 1.0

    def __call__(self, output):
        return output.pow(2).sum()

    def finish(self, loss):
        return loss


def _microbatches(count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randn(5, 4, generator=gen),), {}) for _ in range(count)]


def test_plain_steps_match_a_plain_loop():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    mbs = _microbatches(4)
    outputs = Interpreter(EagerCompute(model), buffers=tuple(model.buffers()),
                          per_step=4)(mbs, LossOf())
    for (args, _), out in zip(mbs, outputs, strict=True):
        ref_out = ref(*args)
        ref_out.pow(2).sum().backward()
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_replica_lanes_keep_their_own_buffers():
    """Two lanes with their own BatchNorm statistics, as two replicas: lane k's buffers
    equal a plain model fed only lane k's micro-batches."""
    torch.manual_seed(0)
    model = Net()
    refs = [copy.deepcopy(model), copy.deepcopy(model)]
    interpreter = Interpreter(EagerCompute(model), buffers=tuple(model.buffers()),
                              per_step=4, replicas=2)
    buffers = ReplicaBuffers(model, 2, broadcast=False)
    interpreter.use_lanes([buffers], broadcast=False)
    mbs = _microbatches(4, seed=1)
    interpreter(mbs, LossOf())
    for n, (args, _) in enumerate(mbs):
        refs[n % 2](*args).pow(2).sum().backward()
    for k in range(2):
        for mine, theirs in zip(buffers.copies[k], refs[k].buffers(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # gradients: the sum over both lanes' micro-batches
    for p, a, b in zip(model.parameters(), refs[0].parameters(), refs[1].parameters(),
                       strict=True):
        torch.testing.assert_close(p.grad, a.grad + b.grad, rtol=1e-6, atol=1e-6)


def test_concurrent_lanes_sum_their_gradients_into_replica_0():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    interpreter = Interpreter(EagerCompute(model), per_step=4, replicas=2)
    interpreter.run_lanes_on(ReplicaCopies(model, [torch.device("cpu")] * 2, False))
    mbs = _microbatches(4, seed=2)
    outputs = interpreter(mbs, LossOf())
    for (args, _), out in zip(mbs, outputs, strict=True):
        ref_out = ref(*args)
        ref_out.pow(2).sum().backward()
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_observer_sees_each_forward_with_its_replica():
    seen = []

    class Observer:
        @contextlib.contextmanager
        def forward(self, microbatch, replica):
            seen.append((microbatch, replica))
            yield

    model = nn.Linear(4, 3)
    interpreter = Interpreter(EagerCompute(model), per_step=4, replicas=2)
    interpreter.observer = Observer()
    interpreter(_microbatches(8), None)
    assert seen == [(n % 4, n % 2) for n in range(8)]
