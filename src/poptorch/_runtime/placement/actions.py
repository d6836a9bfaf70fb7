"""Schedules as data: the action list of every device.

A pipeline schedule is first written per stage (:func:`~.pipeline.gpipe_schedule`,
:func:`~.pipeline.one_f_one_b_schedule`: lists of :class:`~.pipeline.Action`, the
form of ``torch.distributed.pipelining``'s ``_Action`` lists). The engine
runs one worker per *device*, so the stages that share a device are merged into one
action list in the order of an ideal unit-time execution (:func:`device_lanes`): when
stages outnumber devices this interleaves them (stage 0 and stage 2 on device 0 take
turns, as ``ScheduleInterleaved1F1B`` does), and the merged order cannot deadlock,
because an action only waits for actions that come earlier in that execution.
"""
from __future__ import annotations

from collections.abc import Sequence

from .pipeline import BACKWARD, FORWARD, INPUT_HALF, WEIGHT_HALF, Action


def dependencies(op: Action, producers: Sequence[Sequence[int]],
                 consumers: Sequence[Sequence[int]]) -> list[Action]:
    """The actions ``op`` waits for: a forward waits for the forwards of the stages it
    reads from; a backward (or its input half) for its own forward and the backwards
    of its readers (a reader's input half counts as its backward); a weight half for
    its input half."""
    kind, stage, m = op
    if kind == FORWARD:
        return [Action(FORWARD, p, m) for p in producers[stage]]
    if kind == WEIGHT_HALF:
        return [Action(INPUT_HALF, stage, m)]
    return [Action(FORWARD, stage, m)] + [Action(BACKWARD, c, m) for c in consumers[stage]]


def defer_weight_halves(stage_lanes: list[list[Action]],
                        producers: Sequence[Sequence[int]]) -> list[list[Action]]:
    """Split the last backwards of a stage into an input half, where the backward was,
    and a weight half, after the stage's last action: the earlier stages get their
    gradients sooner while the pipeline drains, as in the zero-bubble schedules.

    Stage ``s`` splits its last ``s`` backwards (the stages before it drain one
    backward each after its last one), and only backwards that follow its last forward
    (the cool-down: no activation lives longer than the stage's peak). Each split costs
    a little host time, so no more are split than can overlap the drain. A stage that
    reads from no earlier stage hands no gradient on and keeps its backwards whole."""
    out = []
    for s, lane in enumerate(stage_lanes):
        forwards = [i for i, op in enumerate(lane) if op.kind == FORWARD]
        after = forwards[-1] if forwards else -1
        cool = [i for i, op in enumerate(lane) if op.kind == BACKWARD and i > after]
        split = set(cool[len(cool) - min(s, len(cool)):]) if producers[s] else set()
        ops = [Action(INPUT_HALF, s, op.microbatch) if i in split else op
               for i, op in enumerate(lane)]
        ops += [Action(WEIGHT_HALF, s, lane[i].microbatch) for i in sorted(split)]
        out.append(ops)
    return out


def device_lanes(stage_lanes: list[list[Action]], stage_device: list[int], num_devices: int,
                 producers: Sequence[Sequence[int]],
                 consumers: Sequence[Sequence[int]]) -> list[list[Action]]:
    """Merge per-stage action lists into one list per device (module docstring)."""
    slot: dict[Action, int] = {}
    cursor = [0] * len(stage_lanes)
    free = [0] * len(stage_lanes)
    remaining = sum(len(lane) for lane in stage_lanes)
    while remaining:
        progress = False
        for s, lane in enumerate(stage_lanes):
            while cursor[s] < len(lane):
                op = lane[cursor[s]]
                deps = dependencies(op, producers, consumers)
                if any(d not in slot for d in deps):
                    break
                t = max([free[s]] + [slot[d] + 1 for d in deps])
                slot[op] = t
                if op.kind == INPUT_HALF:  # what the stage's readers wait for
                    slot[Action(BACKWARD, s, op.microbatch)] = t
                free[s] = t + 1
                cursor[s] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError("the per-stage schedules wait for each other")
    lanes: list[list[tuple[int, int, Action]]] = [[] for _ in range(num_devices)]
    for s, lane in enumerate(stage_lanes):
        for op in lane:
            lanes[stage_device[s]].append((slot[op], s, op))
    return [[op for _, _, op in sorted(lane)] for lane in lanes]


def sharded_actions(num_stages: int, num_microbatches: int, training: bool) -> list[Action]:
    """One device busy at a time: each micro-batch goes through the stages, forward
    then backward, before the next starts."""
    ops: list[Action] = []
    for m in range(num_microbatches):
        ops += [Action(FORWARD, s, m) for s in range(num_stages)]
        if training:
            ops += [Action(BACKWARD, s, m) for s in reversed(range(num_stages))]
    return ops
