"""Squared norms of model-sized tensors through temporaries of a bounded size.

`x.double().pow(2).sum()` of a 25 MB bucket makes a 50 MB float64 copy and a second one for the
square; the group error, the consensus measurement and the completeness of every group sum run on
every exchange, so they reduce in chunks of `NORM_CHUNK` elements instead (in float64, whatever the
tensors' dtype).
"""

from __future__ import annotations

import torch

#: elements per temporary in `squared_distance` and `squared_norm`: 1 MiB of float32 (2 MiB in float64)
NORM_CHUNK = 1 << 18


def squared_norm(a: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`||scale * a||^2` as a float64 scalar tensor on `a`'s device, through temporaries of at most
    `NORM_CHUNK` elements (a float64 copy of a whole bucket would be twice its size)."""
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    flat = a.reshape(-1) if a.is_contiguous() else a.contiguous().view(-1)
    for lo in range(0, flat.numel(), NORM_CHUNK):
        total += torch.linalg.vector_norm(flat[lo : lo + NORM_CHUNK], dtype=torch.float64).square()
    return total * (scale * scale)


def squared_distance(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`||a - alpha * b||^2` (same shapes) as a float64 scalar tensor, through a temporary of at most
    `NORM_CHUNK` elements: the difference of two buckets is never materialised whole."""
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    if not (a.is_contiguous() and b.is_contiguous()):  # rare (channels-last weights): one temporary
        return total + torch.linalg.vector_norm(torch.sub(a, b, alpha=alpha), dtype=torch.float64).square()
    a, b = a.view(-1), b.view(-1)
    if a.numel() == 0:
        return total
    part = torch.empty(min(NORM_CHUNK, a.numel()), dtype=a.dtype, device=a.device)
    for lo in range(0, a.numel(), NORM_CHUNK):
        hi = min(lo + NORM_CHUNK, a.numel())
        chunk = part[: hi - lo]
        torch.sub(a[lo:hi], b[lo:hi], alpha=alpha, out=chunk)
        total += torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
    return total


def is_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A boolean scalar tensor: whether every element of `tensor` is finite (no host synchronisation).

    Through the squared norm in float64 (bounded temporaries, where `torch.isfinite(x).all()` makes
    several full-size ones): a NaN or an infinity makes it non-finite, and no finite float32, bfloat16
    or float16 tensor can overflow it (float64 tensors with elements beyond 1e150 would).
    """
    return torch.isfinite(squared_norm(tensor))
