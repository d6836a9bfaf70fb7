"""The device program's own random stream (``Options.randomSeed``)."""
from __future__ import annotations

import torch

__all__ = ["RngScope"]


class RngScope:
    """Runs the device program on its own random-number stream.

    With ``Options.randomSeed`` set, the executor owns a generator state seeded once;
    each call swaps it in and out of torch's default generator, so the same seed gives
    the same results run to run and the host's random stream is left untouched. A
    call that fails leaves the program's stream where it was (the call is undone).
    """

    def __init__(self, seed: int | None, device: torch.device) -> None:
        self.enabled = seed is not None
        self.seed: int | None = None
        self.cuda = device.type == "cuda"
        self.device = device
        self.state: torch.Tensor | None = None
        self.cuda_state: torch.Tensor | None = None
        if seed is not None:
            self.seed = int(seed)
            self.state = torch.Generator().manual_seed(self.seed).get_state()
            if self.cuda:
                g = torch.Generator(device=device).manual_seed(self.seed)
                self.cuda_state = g.get_state()

    def __enter__(self) -> None:
        if not self.enabled:
            return
        assert self.state is not None  # (set with ``enabled``)
        self._saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        if self.cuda:
            assert self.cuda_state is not None
            self._saved_cuda = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.cuda_state, self.device)

    def __exit__(self, exc_type: type[BaseException] | None = None, *exc: object) -> None:
        if not self.enabled:
            return
        if exc_type is None:  # a failed call keeps the state it started from
            self.state = torch.get_rng_state()
        torch.set_rng_state(self._saved)
        if self.cuda:
            if exc_type is None:
                self.cuda_state = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self._saved_cuda, self.device)

    def load(self, seed: int | None, state: torch.Tensor) -> None:
        """Continue from a saved stream (``PoplarExecutor.rng_state``): the stream is
        the program's own from now on."""
        if not self.enabled:
            self.enabled, self.seed = True, seed
        self.state = state.clone()
