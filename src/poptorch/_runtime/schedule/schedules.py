"""Every schedule of a step, as data: per-lane lists of :class:`~.actions.Action`.

A pipeline schedule is written per *stage*, as ``torch.distributed.pipelining`` writes
its ``_Action`` lists, then merged into one list per *device* (:func:`device_lanes`),
which the per-device engine runs with one worker per device. One-lane schedules
(:func:`sharded`, :func:`one_stage_schedule`, :func:`serial_phased`) run on the calling
thread; phased schedules bracket each phase with ``LOAD`` / ``STORE`` of its weights
(Graphcore's load / compute / store phases).

:func:`layout` lays a schedule out in time (:data:`COST` slots per action): that both
merges stages onto devices without deadlock and checks a schedule
(:func:`check_dependencies`: no action before what it consumes, every compute action
once, a stage's actions only while its lane holds its weights).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .actions import MEMORY, Action, ActionKind

__all__ = [
    "DEFAULT",
    "SCHEDULES",
    "Topology",
    "check_dependencies",
    "defer_weight_halves",
    "dependencies",
    "device_lanes",
    "gpipe",
    "handed_over",
    "interleaved_one_f_one_b",
    "layout",
    "one_f_one_b",
    "one_stage_schedule",
    "parallel_phased",
    "pipeline_lanes",
    "schedule_name_of",
    "serial_phased",
    "sharded",
    "simulate",
    "with_loads",
    "zero_bubble",
]

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
IH, W = ActionKind.INPUT_HALF, ActionKind.WEIGHT_HALF
LOAD, STORE, DROP = ActionKind.LOAD, ActionKind.STORE, ActionKind.DROP
ALL_REDUCE, BROADCAST = ActionKind.ALL_REDUCE, ActionKind.BROADCAST

Lanes = list[list[Action]]

#: The pipeline schedules ``PipelinedExecution.setSchedule`` accepts.
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZeroBubble")
#: The default: of the schedules giving the same results, the fastest measured
#: (``benchmarks/bench_parallel.py``).
DEFAULT = "1F1B"

#: The time an action takes in a laid-out schedule, in slots (a backward computes
#: about twice a forward's work; its halves one forward's each; a load or a store of a
#: phase's weights is drawn as long as a forward).
COST = {F: 1, B: 2, IH: 1, W: 1, LOAD: 1, STORE: 1}


def schedule_name_of(name: object) -> str:
    """The canonical spelling of a schedule name (case-insensitive), or ``ValueError``
    naming the valid ones."""
    if isinstance(name, str):
        for known in SCHEDULES:
            if known.lower() == name.lower():
                return known
    raise ValueError(f"Unknown pipeline schedule {name!r}: use one of "
                     + ", ".join(repr(s) for s in SCHEDULES) + ".")


@dataclass(frozen=True)
class Topology:
    """Which stages each stage reads from (``producers``) and is read by
    (``consumers``): the edges along which activations and gradients travel."""
    producers: tuple[tuple[int, ...], ...]
    consumers: tuple[tuple[int, ...], ...]

    @staticmethod
    def chain(num_stages: int) -> Topology:
        """Stage ``s`` reads stage ``s - 1`` only."""
        return Topology.of([(s - 1, ) if s else () for s in range(num_stages)])

    @staticmethod
    def of(producers: Sequence[Sequence[int]]) -> Topology:
        """From each stage's producers; the consumers follow."""
        consumers: list[list[int]] = [[] for _ in producers]
        for s, ps in enumerate(producers):
            for p in ps:
                consumers[p].append(s)
        return Topology(tuple(tuple(p) for p in producers),
                        tuple(tuple(c) for c in consumers))

    @property
    def num_stages(self) -> int:
        return len(self.producers)


def dependencies(op: Action, topo: Topology) -> list[Action]:
    """What ``op`` consumes: a forward, the forwards of the stages it reads; a backward
    (or its input half), its own forward and the backwards of its readers (a reader's
    input half counts as its backward); a weight half, its input half; a memory action,
    nothing (it follows its lane's order)."""
    kind, stage, m = op.kind, op.stage, op.microbatch
    if kind in MEMORY:
        return []
    if kind == F:
        return [Action(F, p, m) for p in topo.producers[stage]]
    if kind == W:
        return [Action(IH, stage, m)]
    return [Action(F, stage, m)] + [Action(B, c, m) for c in topo.consumers[stage]]


def handed_over(op: Action) -> Action:
    """What finishing ``op`` hands over, without its lane (an input half: its stage's
    backward, as far as the readers are concerned)."""
    return Action(B if op.kind == IH else op.kind, op.stage, op.microbatch)


def layout(lanes: Sequence[Sequence[Action]], topo: Topology) -> list[list[int]]:
    """The start slot of every action, per lane in order, when each lane runs its list
    in order, an action starting once its lane is free and what it consumes has
    finished (:data:`COST`); ``ValueError`` if the lanes wait for each other forever."""
    end: dict[Action, int] = {}  # handed-over key (and the I itself) -> finish slot
    starts: list[list[int]] = [[] for _ in lanes]
    free = [0] * len(lanes)
    remaining = sum(len(lane) for lane in lanes)
    while remaining:
        progress = False
        for d, lane in enumerate(lanes):
            while len(starts[d]) < len(lane):
                op = lane[len(starts[d])]
                plain = op._replace(lane=-1)
                deps = dependencies(plain, topo)
                if any(dep not in end for dep in deps):
                    break
                t = max([free[d]] + [end[dep] for dep in deps])
                starts[d].append(t)
                free[d] = t + COST.get(op.kind, 1)
                if op.kind not in MEMORY:  # (nothing waits for a memory action)
                    end[plain] = end[handed_over(plain)] = free[d]
                remaining -= 1
                progress = True
        if not progress:
            stuck = [str(lane[len(starts[d])]) for d, lane in enumerate(lanes)
                     if len(starts[d]) < len(lane)]
            raise ValueError(f"the schedule's lanes wait for each other forever at {stuck}")
    return starts


def simulate(lanes: Sequence[Sequence[Action]], topo: Topology) -> dict[Action, int]:
    """The start slot of every compute action (without its lane) in the
    :func:`layout` of ``lanes``."""
    return {op._replace(lane=-1): t
            for lane, starts in zip(lanes, layout(lanes, topo), strict=True)
            for op, t in zip(lane, starts, strict=True) if op.kind not in MEMORY}


def check_dependencies(lanes: Sequence[Sequence[Action]], topo: Topology) -> None:
    """``ValueError`` unless the schedule runs (:func:`simulate`), runs each compute
    action once, keeps a weight half on its input half's lane, runs a stage's actions
    only while their lane holds its weights (:func:`_check_memory`) and, laid out in
    time, runs no action before one it consumes."""
    seen: set[Action] = set()
    lane_of: dict[Action, int] = {}
    for d, lane in enumerate(lanes):
        _check_memory(lane)
        for op in lane:
            if op.kind in MEMORY:
                continue
            plain = op._replace(lane=-1)
            if plain in seen:
                raise ValueError(f"the schedule runs {plain} twice")
            seen.add(plain)
            lane_of[plain] = d
    for op in seen:
        if op.kind == W and lane_of.get(Action(IH, op.stage, op.microbatch)) != lane_of[op]:
            raise ValueError(f"{op} is not on the lane of its input half")
    start = simulate(lanes, topo)
    order = sorted(start, key=lambda a: (start[a], a.stage, a.kind.value))
    done: set[Action] = set()  # (an input half and its backward both read as the backward)
    for a in order:
        for need in dependencies(a, topo):
            if handed_over(need) not in done:
                raise ValueError(f"schedule runs {handed_over(a)} before "
                                 f"{handed_over(need)}, which it reads")
        done.add(handed_over(a))


def _check_memory(lane: Sequence[Action]) -> None:
    """In a lane that loads weights: each stage loaded before its actions, stored after
    them, never loaded twice at once, and nothing left loaded at the end."""
    if not any(op.kind in MEMORY for op in lane):
        return
    loaded: set[int] = set()
    for op in lane:
        if op.kind == LOAD:
            if op.stage in loaded:
                raise ValueError(f"{op} loads weights its lane already holds")
            loaded.add(op.stage)
        elif op.kind == STORE:
            if op.stage not in loaded:
                raise ValueError(f"{op} stores weights its lane does not hold")
            loaded.discard(op.stage)
        elif op.stage not in loaded:
            raise ValueError(f"{op} runs without its stage's weights on its lane")
    if loaded:
        raise ValueError(f"the lane ends holding the weights of stages {sorted(loaded)}")


# ------------------------------------------------------------------ per stage
def gpipe(num_stages: int, num_microbatches: int, training: bool) -> Lanes:
    """Per stage: all forwards, then all backwards."""
    kinds = (F, B) if training else (F, )
    return [[Action(k, s, m) for k in kinds for m in range(num_microbatches)]
            for s in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Lanes:
    """Per stage: ``num_stages - s - 1`` warm-up forwards, then forward and backward
    alternately, then the remaining backwards."""
    lanes = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        ops = [Action(F, s, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            ops += [Action(F, s, warmup + i), Action(B, s, i)]
        ops += [Action(B, s, m) for m in range(num_microbatches - warmup, num_microbatches)]
        lanes.append(ops)
    return lanes


def defer_weight_halves(stage_lanes: Lanes, topo: Topology) -> Lanes:
    """Split the cool-down backwards of the later stages: stage ``s`` splits its last
    ``s`` backwards that follow its last forward (no activation then lives longer than
    the stage's peak) into an input half, where the backward was, and a weight half,
    after the stage's last action; earlier stages get their gradients sooner while the
    pipeline drains. A stage that reads no earlier stage hands no gradient on and keeps
    its backwards whole (each split costs a little host time)."""
    out = []
    for s, lane in enumerate(stage_lanes):
        forwards = [i for i, op in enumerate(lane) if op.kind == F]
        after = forwards[-1] if forwards else -1
        cool = [i for i, op in enumerate(lane) if op.kind == B and i > after]
        split = set(cool[len(cool) - min(s, len(cool)):]) if topo.producers[s] else set()
        ops = [Action(IH, s, op.microbatch) if i in split else op for i, op in enumerate(lane)]
        ops += [Action(W, s, lane[i].microbatch) for i in sorted(split)]
        out.append(ops)
    return out


def zero_bubble(topo: Topology, num_microbatches: int) -> Lanes:
    """Per stage, the ZB-H1 schedule of the zero-bubble paper: a stage that hands
    gradients on splits its backwards into ``I`` (what the earlier stage waits for) and
    ``W``. Each stage, when free, runs the first ready of: its next input half (or whole
    backward), its next forward while fewer than ``stages - s`` micro-batches hold
    activations (1F1B's bound; held until the weight half), else its oldest pending
    weight half (``ScheduleInterleavedZeroBubble`` also builds its lists by simulation)."""
    n, count = topo.num_stages, num_microbatches
    lanes: Lanes = [[] for _ in range(n)]
    end: dict[Action, int] = {}
    free = [0] * n
    next_f, next_b = [0] * n, [0] * n
    pending: list[list[int]] = [[] for _ in range(n)]
    alive = [0] * n
    total = sum(2 * count + (count if topo.producers[s] else 0) for s in range(n))
    done = 0
    t = 0
    while done < total:
        if t > 4 * total + 8:  # (every action is ready within that many slots)
            raise ValueError("the zero-bubble schedule cannot place its actions")
        for s in range(n):
            if free[s] > t:
                continue
            split = bool(topo.producers[s])
            choice = None
            candidates = [Action(IH if split else B, s, next_b[s])] if next_b[s] < count else []
            if next_f[s] < count and alive[s] < n - s:
                candidates.append(Action(F, s, next_f[s]))
            for op in candidates:
                if all(end.get(dep, t + 1) <= t for dep in dependencies(op, topo)):
                    choice = op
                    break
            if choice is None and pending[s]:
                choice = Action(W, s, pending[s][0])
            if choice is None:
                continue
            lanes[s].append(choice)
            finish = t + COST[choice.kind]
            end[choice] = end[handed_over(choice)] = free[s] = finish
            done += 1
            if choice.kind == F:
                next_f[s] += 1
                alive[s] += 1
            elif choice.kind == W:
                pending[s].pop(0)
                alive[s] -= 1
            else:
                next_b[s] += 1
                if split:
                    pending[s].append(choice.microbatch)
                else:
                    alive[s] -= 1
        t += 1
    return lanes


# ------------------------------------------------------------------ per device
def device_lanes(stage_lanes: Lanes, stage_device: Sequence[int], num_devices: int,
                 topo: Topology) -> Lanes:
    """Merge per-stage lists into one list per device, in the order of their
    laid-out execution (:func:`simulate`): stages sharing a device take turns, and the
    merged order cannot deadlock (an action only waits for earlier ones). Each action
    names its device as its ``lane``."""
    start = simulate(stage_lanes, topo)
    lanes: list[list[tuple[int, int, int, Action]]] = [[] for _ in range(num_devices)]
    for s, lane in enumerate(stage_lanes):
        for i, op in enumerate(lane):
            d = stage_device[s]
            lanes[d].append((start[op._replace(lane=-1)], s, i, op._replace(lane=d)))
    return [[op for *_, op in sorted(lane)] for lane in lanes]


def interleaved_one_f_one_b(stage_device: Sequence[int], num_devices: int,
                            num_microbatches: int, topo: Topology) -> Lanes | None:
    """Per device: each device runs its stages' forwards round by round (up to
    ``devices`` micro-batches through each of its stages in turn), backwards in reverse
    stage order, after ``(stages per device - 1) * devices + 2 * (devices - 1 - rank)``
    warm-up forwards (``ScheduleInterleaved1F1B``'s counts), then one forward / one
    backward. None unless several stages share each device, placed round-robin (stage
    ``s`` on the device of stage ``s % devices``)."""
    n = len(stage_device)
    d = len(set(stage_device))
    if n == d or n % d or any(stage_device[s] != stage_device[s % d] for s in range(n)):
        return None  # (one stage per device: that is 1F1B)
    chunks = n // d
    lanes: Lanes = [[] for _ in range(num_devices)]
    for rank in range(d):
        device = stage_device[rank]
        local = [rank + c * d for c in range(chunks)]
        forwards, backwards = [], []
        for first in range(0, num_microbatches, d):
            mbs = range(first, min(num_microbatches, first + d))
            forwards += [Action(F, s, m, device) for s in local for m in mbs]
            backwards += [Action(B, s, m, device) for s in reversed(local) for m in mbs]
        warmup = min(len(forwards), (chunks - 1) * d + 2 * (d - 1 - rank))
        ops = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards, strict=False):
            ops += [f, b]
        ops += backwards[len(forwards) - warmup:]
        lanes[device] = ops
    simulate(lanes, topo)  # (a placement this order cannot run raises here)
    return lanes


def pipeline_lanes(name: str, topo: Topology, stage_device: Sequence[int],
                   num_devices: int, num_microbatches: int, training: bool) -> Lanes:
    """The per-device lists of the pipeline schedule ``name`` (:data:`SCHEDULES`).
    Inference runs forwards in order (there is no backward to interleave)."""
    n = topo.num_stages
    if not training:
        return device_lanes(gpipe(n, num_microbatches, False), stage_device, num_devices,
                            topo)
    if name == "Interleaved1F1B":
        lanes = interleaved_one_f_one_b(stage_device, num_devices, num_microbatches, topo)
        if lanes is not None:
            return lanes
        name = "1F1B"  # one stage per device, or an irregular placement: merged 1F1B
    if name == "ZeroBubble":
        per_stage = zero_bubble(topo, num_microbatches)
    elif name == "GPipe":
        per_stage = defer_weight_halves(gpipe(n, num_microbatches, True), topo)
    else:
        per_stage = defer_weight_halves(one_f_one_b(n, num_microbatches), topo)
    return device_lanes(per_stage, stage_device, num_devices, topo)


# ------------------------------------------------------------------ one lane
def one_stage_schedule(count: int, training: bool, replicas: int = 1, per_step: int = 1,
                       lane_states: bool = False, broadcast: bool = False,
                       reduce_last: bool = False, lane_copies: bool = False
                       ) -> list[Action]:
    """The actions of ``count`` micro-batches on one stage (``program/interpreter.py``
    runs them), micro-batch ``n`` on lane ``n % replicas``. ``lane_states``: each lane
    has state of its own (``LOAD`` / ``STORE`` around its micro-batches, ``DROP`` at
    the end); ``broadcast``: replica 0's buffers to the others after each step of
    ``per_step`` micro-batches; ``reduce_last``: the last backward of each step reduces
    gradients over the processes; ``lane_copies``: each lane has a model copy on its own
    device (``program/concurrent_replicas.py``), the lanes' gradients summed into
    replica 0's after each step (``ALL_REDUCE`` of the calling thread, lane -1)."""
    if lane_copies:
        return _copies_schedule(count, training, replicas, per_step, broadcast)
    actions: list[Action] = []
    for n in range(count):
        lane = n % replicas
        last = (n + 1) % per_step == 0
        if lane_states:
            actions.append(Action(LOAD, 0, n, lane))
        if training and reduce_last and last:
            actions.append(Action(ALL_REDUCE, 0, n, lane))
        actions.append(Action(F, 0, n, lane))
        if training:
            actions.append(Action(B, 0, n, lane))
        if lane_states:
            actions.append(Action(STORE, 0, n, lane))
            if broadcast and last:
                actions.append(Action(BROADCAST, 0, n, 0))
    if lane_states:
        actions.append(Action(DROP, 0, -1, 0))
    return actions


def _copies_schedule(count: int, training: bool, replicas: int, per_step: int,
                     broadcast: bool) -> list[Action]:
    actions: list[Action] = []
    for n in range(count):
        actions.append(Action(F, 0, n, n % replicas))
        if training:
            actions.append(Action(B, 0, n, n % replicas))
        if (n + 1) % per_step == 0 or n == count - 1:
            if training:
                actions.append(Action(ALL_REDUCE, 0, -1, -1))
            if broadcast:
                actions.append(Action(BROADCAST, 0, -1, -1))
    return actions


def sharded(num_stages: int, num_microbatches: int, training: bool) -> list[Action]:
    """Each micro-batch through the stages, forward then backward, before the next."""
    ops: list[Action] = []
    for m in range(num_microbatches):
        ops += [Action(F, s, m, 0) for s in range(num_stages)]
        if training:
            ops += [Action(B, s, m, 0) for s in reversed(range(num_stages))]
    return ops


def serial_phased(stage_order: Sequence[int], num_microbatches: int,
                  training: bool) -> list[Action]:
    """Stage after stage on one lane, all micro-batches of a stage together (forward in
    ``stage_order``, backward in reverse): a phase's weights are loaded once a pass."""
    ops = [Action(F, s, m, 0) for s in stage_order for m in range(num_microbatches)]
    if training:
        ops += [Action(B, s, m, 0) for s in reversed(stage_order)
                for m in range(num_microbatches)]
    return with_loads(ops, 0)


def parallel_phased(num_phases: int, num_microbatches: int, training: bool,
                    stage_device: Sequence[int], num_devices: int) -> Lanes:
    """Phases (one stage each) phase-major, each on its device; the even and the odd
    phases sit on different devices, so phase ``p + 1`` of one micro-batch overlaps
    phase ``p`` of the next."""
    lanes: Lanes = [[] for _ in range(num_devices)]
    order = list(range(num_phases))
    if training:
        order += list(reversed(order))
    for i, p in enumerate(order):
        kind = F if i < num_phases else B
        d = stage_device[p]
        lanes[d] += [Action(kind, p, m, d) for m in range(num_microbatches)]
    return [with_loads(lane, d) for d, lane in enumerate(lanes)]


def with_loads(ops: Sequence[Action], lane: int) -> list[Action]:
    """``ops`` with each run of one stage's actions between a ``LOAD`` of its weights
    and a ``STORE`` of them (a phase's weights on its device only while it runs)."""
    out: list[Action] = []
    held: int | None = None
    for op in ops:
        if op.stage != held:
            if held is not None:
                out.append(Action(STORE, held, -1, lane))
            out.append(Action(LOAD, op.stage, -1, lane))
            held = op.stage
        out.append(op)
    if held is not None:
        out.append(Action(STORE, held, -1, lane))
    return out
