"""Per-parameter update rules of the poptorch.optim optimizers, in plain torch ops.

Each function updates one parameter ``p`` in place from its gradient ``g`` (already
unscaled, in the accumulator dtype, held in the compute dtype; never modified in
place) and keeps its state in the dtypes the optimizer asked for. The arithmetic
follows torch.optim's single-tensor implementations operation for operation, so in
float32 the results agree with torch.optim to rounding.
"""
from __future__ import annotations

import torch

from .._typing import ParamGroup
from .base import Optimizer, ParamState, apply_to_param, state_view

State = ParamState
_store = Optimizer._store
_next_step = Optimizer._next_step


def sgd(p: torch.Tensor, g: torch.Tensor, group: ParamGroup, state: State, *,
        combined: bool, velocity_dtype: torch.dtype) -> None:
    """SGD with momentum, separate (velocity in ``velocity_dtype``) or combined variant
    (one tensor in the parameter dtype holding ``velocity_scaling * velocity``)."""
    lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
    if group["maximize"]:
        g = -g
    if group["weight_decay"] != 0:
        g = g.add(p, alpha=group["weight_decay"])
    if momentum != 0:
        scale = group["velocity_scaling"] if combined else 1.0
        if "momentum_buffer" not in state:
            buf = g * scale if scale != 1.0 else g.clone()
        else:
            buf = state_view(state, "momentum_buffer", p)
            buf.mul_(momentum).add_(g, alpha=(1 - dampening) * scale)
        buf = _store(state, "momentum_buffer", buf, p.dtype if combined else velocity_dtype)
        velocity = buf / scale if scale != 1.0 else buf
        g = g.add(velocity, alpha=momentum) if group["nesterov"] else velocity
    apply_to_param(p, lambda w: w.add_(g, alpha=-lr))


def adam(p: torch.Tensor, g: torch.Tensor, group: ParamGroup, state: State, *,
         decoupled: bool, bias_correction: bool, first_dtype: torch.dtype,
         second_dtype: torch.dtype) -> None:
    """Adam (L2 weight decay in the gradient) or AdamW (decoupled weight decay)."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    step = _next_step(state)
    if group["maximize"]:
        g = -g
    if weight_decay != 0:
        if decoupled:
            apply_to_param(p, lambda w: w.mul_(1 - lr * weight_decay))
        else:
            g = g.add(p, alpha=weight_decay)
    exp_avg = state_view(state, "exp_avg", p)
    exp_avg_sq = state_view(state, "exp_avg_sq", p)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg = _store(state, "exp_avg", exp_avg, first_dtype)
    exp_avg_sq = _store(state, "exp_avg_sq", exp_avg_sq, second_dtype)
    if bias_correction:
        step_size = lr / (1 - beta1 ** step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    else:
        step_size = lr
        denom = exp_avg_sq.sqrt().add_(eps)
    apply_to_param(p, lambda w: w.addcdiv_(exp_avg, denom, value=-step_size))


def rmsprop(p: torch.Tensor, g: torch.Tensor, group: ParamGroup, state: State, *,
            tf_variant: bool, first_dtype: torch.dtype, second_dtype: torch.dtype) -> None:
    """RMSprop as in torch.optim, or the TensorFlow variant (mean square starts at one,
    eps inside the square root, learning rate inside the momentum buffer)."""
    lr, alpha, eps, momentum = group["lr"], group["alpha"], group["eps"], group["momentum"]
    _next_step(state)
    if group["maximize"]:
        g = -g
    if group["weight_decay"] != 0:
        g = g.add(p, alpha=group["weight_decay"])
    square_avg = state_view(state, "square_avg", p, fill=1.0 if tf_variant else 0.0)
    square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    square_avg = _store(state, "square_avg", square_avg, second_dtype)
    if group["centered"]:
        grad_avg = state_view(state, "grad_avg", p)
        grad_avg.lerp_(g, 1 - alpha)
        grad_avg = _store(state, "grad_avg", grad_avg, first_dtype)
        mean_square = square_avg.addcmul(grad_avg, grad_avg, value=-1)
    else:
        mean_square = square_avg
    avg = mean_square.add(eps).sqrt_() if tf_variant else mean_square.sqrt().add_(eps)
    # The momentum buffer (in ipu_state from compile on) is kept current even with
    # momentum 0, as PopTorch's accumulator is: it then holds the last update, so raising
    # momentum later continues from it. Same arithmetic as torch.optim's momentum path.
    buf = state_view(state, "momentum_buffer", p)
    if tf_variant:
        buf.mul_(momentum).addcdiv_(g, avg, value=lr)
        buf = _store(state, "momentum_buffer", buf, first_dtype)
        apply_to_param(p, lambda w: w.sub_(buf))
    else:
        buf.mul_(momentum).addcdiv_(g, avg)
        buf = _store(state, "momentum_buffer", buf, first_dtype)
        apply_to_param(p, lambda w: w.add_(buf, alpha=-lr))


def lamb(p: torch.Tensor, g: torch.Tensor, group: ParamGroup, state: State, *,
         bias_correction: bool, max_weight_norm: float | None,
         first_dtype: torch.dtype, second_dtype: torch.dtype) -> None:
    """LAMB (You et al. 2019): an Adam direction plus decoupled weight decay, scaled
    per tensor by the trust ratio ``phi(||w||) / ||r||`` with
    ``phi(z) = min(z, max_weight_norm)``."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    step = _next_step(state)
    exp_avg = state_view(state, "exp_avg", p)
    exp_avg_sq = state_view(state, "exp_avg_sq", p)
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg = _store(state, "exp_avg", exp_avg, first_dtype)
    exp_avg_sq = _store(state, "exp_avg_sq", exp_avg_sq, second_dtype)
    if bias_correction:
        m_hat = exp_avg / (1 - beta1 ** step)
        v_hat = exp_avg_sq / (1 - beta2 ** step)
    else:
        m_hat, v_hat = exp_avg, exp_avg_sq
    wide = p.to(exp_avg.dtype)
    ratio = m_hat / (v_hat.sqrt() + eps)
    if weight_decay != 0:
        ratio = ratio + weight_decay * wide
    weight_norm = torch.linalg.vector_norm(wide)
    if max_weight_norm is not None:
        weight_norm = weight_norm.clamp(max=max_weight_norm)
    ratio_norm = torch.linalg.vector_norm(ratio)
    trust = torch.where((weight_norm > 0) & (ratio_norm > 0),
                        weight_norm / ratio_norm, torch.ones_like(weight_norm))
    apply_to_param(p, lambda w: w.sub_(ratio * (lr * trust)))
