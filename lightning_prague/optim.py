"""Optimizers for decentralized training.

`AccumAdam` is Adam with the *accumulation technique* of decentralized Adam ("From promise
to practice", ICLR 2025): parameters (and the gossip that mixes them) move every step, but the
persistent moments `m` and `v` advance only every `accum_steps` (tau) steps, with the mean
gradient of those steps, so the moments see a tau-times larger batch and are less noisy. With
`k = ceil(t / tau)` step `t` uses

    m_hat = b1 m_{k-1} + (1 - b1) g_t,    v_hat = b2 v_{k-1} + (1 - b2) g_t^2
    x <- x - lr * (m_hat / (1 - b1^k)) / (sqrt(v_hat / (1 - b2^k)) + eps)

and at every `t` that is a multiple of tau, with `g_bar` the mean gradient of the last tau
steps, `m_k = b1 m_{k-1} + (1 - b1) g_bar` and `v_k = b2 v_{k-1} + (1 - b2) g_bar^2`.
With `accum_steps=1` it is exactly `torch.optim.Adam` (`AccumAdamW`: `torch.optim.AdamW`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from lightning_prague.core.errors import ConfigurationError


class AccumAdam(Optimizer):
    """Adam whose moments advance every `accum_steps` steps; see the module docstring.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient, or with `decoupled_weight_decay` the
            AdamW decay `x <- x (1 - lr * weight_decay)`.
        accum_steps: tau, the steps whose mean gradient advances the moments once.
        decoupled_weight_decay: AdamW-style decay instead of an L2 penalty.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_steps: int = 4,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if lr < 0:
            raise ConfigurationError(f"lr={lr} is invalid: it must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ConfigurationError(f"betas={betas} is invalid: two values in [0, 1)")
        if eps < 0:
            raise ConfigurationError(f"eps={eps} is invalid: it must be >= 0")
        if weight_decay < 0:
            raise ConfigurationError(f"weight_decay={weight_decay} is invalid: it must be >= 0")
        if int(accum_steps) != accum_steps or accum_steps < 1:
            raise ConfigurationError(f"accum_steps={accum_steps} is invalid: a whole number of steps, at least 1")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            accum_steps=int(accum_steps),
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            tau = group["accum_steps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AccumAdam does not support sparse gradients")
                self._update(p, group, beta1, beta2, tau)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float, tau: int) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["grad_sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = state["step"]
        k = math.ceil(t / tau)
        lr, wd = group["lr"], group["weight_decay"]
        grad = p.grad
        if wd and group["decoupled_weight_decay"]:
            p.mul_(1.0 - lr * wd)
        elif wd:
            grad = grad.add(p, alpha=wd)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_hat = m.mul(beta1).add_(grad, alpha=1.0 - beta1)
        v_hat = v.mul(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias1, bias2 = 1.0 - beta1**k, 1.0 - beta2**k
        denom = (v_hat.sqrt() / math.sqrt(bias2)).add_(group["eps"])
        p.addcdiv_(m_hat, denom, value=-lr / bias1)
        state["grad_sum"].add_(grad)
        if t % tau == 0:  # the moments advance once per tau steps, with the mean gradient
            mean = state["grad_sum"].div_(tau)
            m.mul_(beta1).add_(mean, alpha=1.0 - beta1)
            v.mul_(beta2).addcmul_(mean, mean, value=1.0 - beta2)
            state["grad_sum"].zero_()


class AccumAdamW(AccumAdam):
    """`AccumAdam` with decoupled (AdamW) weight decay, default `weight_decay=1e-2` as in AdamW."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        accum_steps: int = 4,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, accum_steps, decoupled_weight_decay=True)


__all__ = ["AccumAdam", "AccumAdamW"]
