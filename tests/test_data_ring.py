"""The accessor's hand-over (poptorch/data/ring.py): order across log and pipe, and
slots freed through shared memory."""
import multiprocessing

import pytest

from poptorch.data.ring import ON_PIPE, BatchRing

SLOTS = 3


def _emit(ring, results, plan, freed_out):
    """The worker's side: ``plan`` entries ("log", epoch, slot) are published, ("pipe",
    payload) sent through the pipe, never more than SLOTS batches outstanding (as the
    real worker: a batch holds a slot until it is freed); then report the slots it was
    given back, in order."""
    got, outstanding = [], 0

    def take():
        slot = ring.take_freed(5.0)
        assert slot is not None, "a freed slot never arrived"
        got.append(slot)

    for step in plan:
        if step[0] == "log":
            if outstanding == SLOTS:
                take()
                outstanding -= 1
            ring.publish(step[1], step[2])
            outstanding += 1
        else:
            ring.announce()
            results.send(step[1])
    for _ in range(outstanding):
        take()
    freed_out.send(got)


def _run(plan, context_name="fork"):
    context = multiprocessing.get_context(context_name)
    ring = BatchRing(context, SLOTS)
    results_reader, results_writer = context.Pipe(duplex=False)
    freed_reader, freed_writer = context.Pipe(duplex=False)
    worker = context.Process(target=_emit, args=(ring, results_writer, plan,
                                                 freed_writer))
    worker.start()
    received = []
    for _ in plan:
        # (a spawned worker imports torch before its first message: minutes on a busy
        # machine; later messages follow at once)
        news = ring.next_message(5.0 if received else 120.0)
        assert news is not None, "a message was announced but never arrived"
        if news is ON_PIPE:
            assert results_reader.poll(5.0), "announced on the pipe but never sent"
            received.append(("pipe", results_reader.recv()))
        else:
            received.append(("log", *news))
            ring.free(news[1])  # hand the slot back
    assert freed_reader.poll(10.0)
    frees = freed_reader.recv()
    worker.join(10)
    assert worker.exitcode == 0
    return received, frees


def test_messages_arrive_in_emission_order_whichever_way_they_travel():
    # more log entries than slots (the log wraps), pipe messages between and around them
    plan = [("pipe", "first")]
    for n in range(10):
        plan.append(("log", n, n % SLOTS))
        if n % 4 == 3:
            plan.append(("pipe", f"after {n}"))
    plan.append(("pipe", "end"))
    received, frees = _run(plan)
    assert received == [tuple(step) for step in plan]
    assert frees == [n % SLOTS for n in range(10)]  # in the order they were freed


def test_a_pipe_message_larger_than_the_pipe_buffer_does_not_deadlock():
    big = "x" * (1 << 20)  # 1 MiB: the sender blocks until the reader reads
    received, _ = _run([("log", 0, 0), ("pipe", big), ("log", 0, 1)])
    assert received == [("log", 0, 0), ("pipe", big), ("log", 0, 1)]


@pytest.mark.parametrize("context_name", ["spawn"])
def test_the_ring_reaches_a_spawned_worker(context_name):
    received, frees = _run([("pipe", "hello"), ("log", 7, 2)], context_name)
    assert received == [("pipe", "hello"), ("log", 7, 2)]
    assert frees == [2]


def test_nothing_announced_is_a_timeout_not_a_hang():
    ring = BatchRing(multiprocessing.get_context("fork"), SLOTS)
    assert ring.next_message(0.01) is None
    assert ring.take_freed() is None
