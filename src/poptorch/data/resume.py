"""Where a data loader is in its stream of batches, and how to start again from there.

A loader's position is ``(start, consumed, finished)``: ``start`` is the state of the
random source of the loader's sampler captured right before an epoch's order was drawn
(a ``torch.Generator`` state, or the global torch RNG state when the sampler draws from
it, plus the epoch counter of samplers that have one), ``consumed`` how many batches of
that epoch the caller received, ``finished`` whether the epoch ended. Restoring puts the
random source back to ``start``, draws the same order, and skips ``consumed`` batches of
indices without loading them (a map-style data set); an iterable data set is read and the
first ``consumed`` batches are dropped instead.

Why capture *right before the draw*: torch's iterators draw other numbers from the same
generator (each new iterator draws a base seed for its workers; a persistent-workers
iterator reused for the next epoch does not), so the state at any other point would not
give the same order in a new process.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol, cast

import torch

from .._typing import DatasetKey
from ..errors import Error, PoptorchValueError

__all__ = ["STATE_VERSION", "ResumableIndexSampler", "check_state"]

STATE_VERSION = 1
_GLOBAL = "global"
_GENERATOR = "generator"


class IndexSampler(Protocol):
    """A loader's (batch) sampler: keys into its data set, and how many."""

    def __iter__(self) -> Iterator[DatasetKey]: ...
    def __len__(self) -> int: ...


class _EpochCounter(Protocol):
    epoch: int


def _random_source(index_sampler: object
                   ) -> tuple[torch.Generator | None, _EpochCounter | None]:
    """``(generator or None for the global RNG, sampler with an epoch counter or None)``
    of the sampler behind ``index_sampler`` (a batch sampler wrapping a sampler)."""
    node: object = index_sampler
    generator: torch.Generator | None = None
    epoch_owner: _EpochCounter | None = None
    for _ in range(4):  # CombinedBatchSampler -> batch_sampler -> sampler
        if node is None:
            break
        if epoch_owner is None and isinstance(getattr(node, "epoch", None), int):
            epoch_owner = cast(_EpochCounter, node)
        candidate = getattr(node, "generator", None)
        if isinstance(candidate, torch.Generator) and generator is None:
            generator = candidate
        node = getattr(node, "batch_sampler", None) or getattr(node, "sampler", None)
    return generator, epoch_owner


class ResumableIndexSampler:
    """Wraps a loader's index sampler: records the random state before each epoch's
    draw and starts one epoch at a given position when asked to.

    ``owns_global_rng``: True in the asynchronous accessor's worker process, where the
    global RNG serves only the loader; in the caller's process it is also the model's, so
    a restore there puts it back as it was after drawing the epoch's order.
    """

    def __init__(self, inner: IndexSampler, loader: torch.utils.data.DataLoader) -> None:
        self.inner = inner
        # What decides whether the loader's next iterator draws a base seed (not the
        # loader itself: a reference to it would make a cycle that only gc breaks).
        self.loader_generator = loader.generator
        self.reuses_iterator = loader.persistent_workers and loader.num_workers > 0
        self.owns_global_rng = False
        # Global RNG state from before the resumed pass's torch iterator drew its base
        # seed (in the caller's process): what a mid-epoch restore puts back.
        self.global_rng_before_iterator: torch.Tensor | None = None
        self.last_start: dict | None = None  # capture of the epoch most recently started
        self.epochs_started = 0
        self.resume: dict | None = None
        # index batches per batch handed out (a batch_sampler's micro-batches per
        # combined batch): how many to skip per consumed batch
        self.index_batches_per_batch = 1

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[DatasetKey]:
        return self._epoch()

    # -- capture and restore ------------------------------------------------------------
    def _capture(self) -> dict:
        generator, epoch_owner = _random_source(self.inner)
        return {"kind": _GENERATOR if generator is not None else _GLOBAL,
                "rng": (generator.get_state() if generator is not None
                        else torch.get_rng_state()),
                "sampler_epoch": epoch_owner.epoch if epoch_owner is not None else None}

    def _apply(self, start: dict) -> torch.Tensor | None:
        """Puts the random source at ``start``; returns what to put back afterwards."""
        generator, epoch_owner = _random_source(self.inner)
        kind = _GENERATOR if generator is not None else _GLOBAL
        if kind != start["kind"]:
            raise Error(f"This loader state was saved from a loader whose sampler draws "
                        f"from {start['kind']!r} randomness, but this loader's draws from "
                        f"{kind!r}: build the loader with the same arguments and seed.")
        if epoch_owner is not None and start["sampler_epoch"] is not None:
            epoch_owner.epoch = start["sampler_epoch"]
        if generator is not None:
            generator.set_state(start["rng"])
            return None
        previous = None if self.owns_global_rng else torch.get_rng_state()
        torch.set_rng_state(start["rng"])
        return previous

    def _base_seed_drawn_next(self) -> bool:
        """Will the loader's next epoch draw a worker base seed from the sampler's random
        source before the order (a new torch iterator: not a reused persistent one)?"""
        generator, _ = _random_source(self.inner)
        return self.loader_generator is generator and not self.reuses_iterator

    # -- one epoch ------------------------------------------------------------------------
    def _epoch(self) -> Iterator[DatasetKey]:
        resume, self.resume = self.resume, None
        if resume is not None and resume["finished"]:
            # The saved epoch ended: draw its order again (and the base seed the next
            # iterator drew) so that the random source is where the original run was.
            put_back = self._apply(resume["start"])
            for _ in self.inner:
                pass
            if self._base_seed_drawn_next() and put_back is None:
                torch.empty((), dtype=torch.int64).random_(generator=self.loader_generator)
            if put_back is not None:
                torch.set_rng_state(put_back)
            resume = None
        if resume is None:
            self.last_start = self._capture()
            self.epochs_started += 1
            yield from self.inner
            return
        put_back = self._apply(resume["start"])
        if put_back is not None and self.global_rng_before_iterator is not None:
            # the original pass drew its base seed before its order: not again here
            put_back = self.global_rng_before_iterator
        self.global_rng_before_iterator = None
        self.last_start = resume["start"]
        self.epochs_started += 1
        iterator = iter(self.inner)
        try:
            first = next(iterator)  # the order is drawn now
        except StopIteration:
            return
        finally:
            if put_back is not None:
                torch.set_rng_state(put_back)
        yield from itertools.islice(itertools.chain([first], iterator),
                                    resume["consumed"] * self.index_batches_per_batch,
                                    None)


def check_state(state: object) -> dict:
    """Validates a loader state from ``DataLoader.state_dict()``."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise PoptorchValueError("DataLoader.load_state_dict needs a dict returned by "
                                 "DataLoader.state_dict() (version "
                                 f"{STATE_VERSION}); got {type(state).__name__}.")
    consumed = state.get("consumed")
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise PoptorchValueError(
            f"state['consumed'] must be an integer >= 0; got {consumed!r}.")
    start = state.get("start")
    if start is not None and (not isinstance(start, dict) or
                              start.get("kind") not in (_GLOBAL, _GENERATOR)):
        raise PoptorchValueError("state['start'] is not a loader position saved by "
                                 "DataLoader.state_dict().")
    return state
