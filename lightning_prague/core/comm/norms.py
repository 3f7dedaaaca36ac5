"""Squared norms of model-sized tensors through temporaries of a bounded size, and the drift metric.

`x.double().pow(2).sum()` of a 25 MB bucket makes a 50 MB float64 copy and a second one for the
square; the group error and the consensus measurement run on every exchange, so they reduce in
chunks of `NORM_CHUNK` elements instead (in float64, whatever the tensors' dtype). `Drift` is the
one measure of how far replicas are from their average, built on them.
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


def relative_error(distance: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """`distance / norm` (both squared norms, scalar tensors), 0 when both are 0, inf when only norm is."""
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    zero_norm = torch.where(distance == 0, torch.zeros_like(distance), torch.full_like(distance, float("inf")))
    return torch.where(norm > 0, distance / safe, zero_norm)


class Drift:
    """The drift metric: how far replicas are from their average, `||x - avg||^2 / ||avg||^2`.

    For one member of a group average (`average_`, a gossip round) it is that member's group error
    (`consensus/group_error`); with `distance` summed over every replica and `replicas` their number
    it is the consensus error `mean_i ||x_i - x_bar||^2 / ||x_bar||^2` (`consensus/error`). Every
    place that measures drift accumulates it here, bucket by bucket, so all report the same quantity.

    Both squared norms are float64 scalar tensors on `device`, accumulated through the bounded
    temporaries of this module; nothing is read on the host until the caller reads `error`.
    """

    def __init__(self, device: torch.device) -> None:
        #: `sum ||x - avg||^2` over the buckets added so far (a collective may sum it over replicas)
        self.distance = torch.zeros((), dtype=torch.float64, device=device)
        #: `||avg||^2` over the buckets added so far
        self.norm = torch.zeros((), dtype=torch.float64, device=device)

    def add_average(self, total: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Add one bucket of the average, `avg = scale * total`; returns its squared norm."""
        bucket_norm = squared_norm(total, scale)
        self.norm += bucket_norm
        return bucket_norm

    def add_distance(self, mine: torch.Tensor, total: torch.Tensor, scale: float = 1.0) -> None:
        """Add `||mine - scale * total||^2`: this replica's tensor against the average's (same shapes)."""
        self.distance += squared_distance(mine, total, alpha=scale)

    def add_difference(self, difference: torch.Tensor) -> None:
        """Add `||difference||^2`, where `difference` already is `avg - mine` (an average that
        computes it in place needs no second temporary)."""
        self.distance += squared_norm(difference)

    def error(self, replicas: int = 1, applied: bool = True) -> torch.Tensor:
        """`(distance / replicas) / norm` as a scalar tensor (0 when both are 0, inf when only the
        norm is); 0 if the average was not `applied` (nothing was measured then)."""
        if not applied:
            return torch.zeros_like(self.distance)
        distance = self.distance if replicas == 1 else self.distance / replicas
        return relative_error(distance, self.norm)
