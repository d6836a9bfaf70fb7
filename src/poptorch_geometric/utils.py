"""``set_aggregation_dim_size`` (a fixed number of output rows for every message
passing layer) and ``TrainingStepper`` (a PopTorch model trained side by side with the
same model in plain PyTorch)."""
from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch_geometric.nn import MessagePassing

import poptorch

__all__ = ["TrainingStepper", "set_aggregation_dim_size"]


def set_aggregation_dim_size(model: torch.nn.Module, dim_size: int) -> None:
    """Makes every ``MessagePassing`` layer of ``model`` aggregate into ``dim_size``
    rows (PyG's ``dim_size`` of the aggregation), instead of rows up to the largest
    target index of the edges: the layers' outputs then have a fixed shape.

    ``dim_size`` must be at least the number of nodes of a batch (padding included).
    """
    if isinstance(dim_size, bool) or not isinstance(dim_size, int) or dim_size < 1:
        raise ValueError(f"set_aggregation_dim_size: dim_size must be a positive int, got "
                         f"{dim_size!r}.")

    def set_dim_size(module: torch.nn.Module, inputs: tuple[dict[str, Any]]) -> Any:
        aggregate_kwargs = dict(inputs[-1])
        aggregate_kwargs["dim_size"] = dim_size
        return (aggregate_kwargs,)

    for module in model.modules():
        if isinstance(module, MessagePassing):
            module.register_aggregate_forward_pre_hook(set_dim_size)


class TrainingStepper:
    """Trains a PopTorch copy and a plain PyTorch copy of ``model`` step by step on the
    same batches and checks that their outputs, losses and parameters stay equal.

    The model's ``forward`` returns ``(output, loss)`` in training mode and the output
    in eval mode.

    Args:
        model: The model (not changed: both sides train copies).
        lr: The learning rate of both optimizers.
        optimizer: The optimizer class (a ``poptorch.optim`` one or a torch one).
        options: The :py:class:`poptorch.Options` of the PopTorch side.
        rtol, atol: Tolerances of the comparisons (``torch.testing.assert_close``'s
            defaults when None).
        enable_fp_exception: Turn on floating-point exceptions in the options.
        equal_nan: NaNs compare equal.
    """

    def __init__(self, model: torch.nn.Module, lr: float = 0.001,
                 optimizer: Callable[..., torch.optim.Optimizer] = poptorch.optim.Adam,
                 options: poptorch.Options | None = None, rtol: float | None = None,
                 atol: float | None = None, enable_fp_exception: bool = True,
                 equal_nan: bool = False) -> None:
        model.train()
        self.lr = lr
        self.rtol = rtol
        self.atol = atol
        self.equal_nan = equal_nan
        self.enable_fp_exception = enable_fp_exception
        self.options = poptorch.Options() if options is None else options
        self.training_model: Any = None
        self.inference_model: Any = None
        self.cpu_model = copy.deepcopy(model)
        parameters = list(self.cpu_model.parameters())
        self.optimizer = optimizer(parameters, lr=lr) if parameters else None
        self._setup_poptorch(model, optimizer)
        self.check_parameters()

    def _setup_poptorch(self, model: torch.nn.Module,
                        optimizer: Callable[..., torch.optim.Optimizer]) -> None:
        self.ipu_model = copy.deepcopy(model)
        if self.enable_fp_exception:
            self.options.Precision.enableFloatingPointExceptions(True)
        parameters = list(self.ipu_model.parameters())
        if parameters:
            self.training_model = poptorch.trainingModel(
                self.ipu_model, optimizer=optimizer(parameters, lr=self.lr),
                options=self.options)
        self.inference_model = poptorch.inferenceModel(self.ipu_model, options=self.options)

    def check_parameters(self) -> None:
        """Both copies have equal parameters."""
        for (name, cpu), (_, ipu) in zip(self.cpu_model.named_parameters(),
                                         self.ipu_model.named_parameters(), strict=True):
            self.assert_close(actual=ipu, expected=cpu, id=name)

    def cpu_step(self, batch: Sequence[Any]) -> tuple[Any, torch.Tensor]:
        """One training step of the plain PyTorch copy."""
        if self.optimizer is None:
            raise ValueError("TrainingStepper: the model has no parameters to train.")
        self.optimizer.zero_grad()
        out, loss = self.cpu_model(*batch)
        loss.backward()
        self.optimizer.step()
        return out, loss

    def ipu_step(self, batch: Sequence[Any], copy_weights: bool = True
                 ) -> tuple[Any, torch.Tensor]:
        """One training step of the PopTorch copy (its weights then copied to the host
        model unless ``copy_weights`` is False)."""
        out, loss = self.training_model(*batch)
        if copy_weights:
            self.training_model.copyWeightsToHost()
        return out, loss

    def run(self, num_steps: int, batch: Sequence[Any],
            ipu_batch: Sequence[Any] | None = None) -> None:
        """Trains both copies ``num_steps`` steps on ``batch`` (the PopTorch copy on
        ``ipu_batch`` when given: then only the outputs' common leading rows are
        compared) and checks outputs and parameters after each step, losses at the
        end."""
        if self.training_model is None:
            raise ValueError("TrainingStepper: the training model was not created (the "
                             "model has no parameters).")
        self.cpu_model.train()
        cpu_loss = torch.empty(num_steps)
        ipu_loss = torch.empty(num_steps)
        for step in range(num_steps):
            cpu_out, cpu_loss[step] = self.cpu_step(batch)
            ipu_out, ipu_loss[step] = self.ipu_step(batch if ipu_batch is None else ipu_batch)
            if ipu_batch is not None:
                rows = min(cpu_out.shape[0], ipu_out.shape[0])
                cpu_out, ipu_out = cpu_out[:rows], ipu_out[:rows]
            self.assert_close(actual=ipu_out, expected=cpu_out, id="Output")
            self.check_parameters()
        self.assert_close(actual=ipu_loss, expected=cpu_loss, id="loss")

    def run_inference(self, batch: Sequence[Any]) -> None:
        """Checks that both copies give the same output in eval mode."""
        self.cpu_model.eval()
        with torch.no_grad():
            cpu_out = self.cpu_model(*batch)
        ipu_out = self.inference_model(*batch)
        if isinstance(ipu_out, tuple) and not isinstance(cpu_out, tuple):
            ipu_out = ipu_out[0]
        self.assert_close(actual=ipu_out, expected=cpu_out, id="inference")

    def assert_close(self, actual: Any, expected: Any, id: str) -> None:
        """``torch.testing.assert_close`` with the stepper's tolerances, naming ``id``."""
        torch.testing.assert_close(actual=actual, expected=expected,
                                   msg=lambda msg: f"{id} was not equal:\n\n{msg}\n",
                                   rtol=self.rtol, atol=self.atol, equal_nan=self.equal_nan)

    def benchmark(self, num_steps: int, batch: Sequence[Any],
                  devices: Sequence[str] = ("ipu",)) -> dict[str, float]:
        """Seconds for ``num_steps`` training steps after a first one: ``"ipu_time"``
        for the PopTorch copy (on the device the options choose), ``"cpu_time"`` for the
        plain PyTorch copy, as ``devices`` asks (``"ipu"``, ``"cpu"``)."""
        unknown = set(devices) - {"ipu", "cpu"}
        if unknown:
            raise ValueError(f"TrainingStepper.benchmark: unknown devices {sorted(unknown)};"
                             " use 'ipu' (the PopTorch model, on the device its options "
                             "choose: a GPU when they say so) and 'cpu'.")
        results = {}
        steps: dict[str, Callable[[], Any]] = {
            "ipu": lambda: self.ipu_step(batch, copy_weights=False),
            "cpu": lambda: self.cpu_step(batch)}
        for device in ("ipu", "cpu"):
            if device in devices:
                steps[device]()
                start = time.perf_counter()
                for _ in range(num_steps):
                    steps[device]()
                results[f"{device}_time"] = time.perf_counter() - start
        return results
