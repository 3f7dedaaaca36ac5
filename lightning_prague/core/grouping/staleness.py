"""Staleness-aware weights of Partial Reduce's dynamic mode.

A group's members report their model versions `t_j` (local updates so far). A member's staleness
is `s_j = t_max - t_j + 1` (the freshest has 1). With `T = max s_j`, staleness level `s`
gets the mass `alpha^(s-1) (1-alpha) / (1 - alpha^T)`, shared equally by the `c_s` members at
that level; the mass of levels nobody is at goes to level 1. The weights sum to 1, fresher
models count more, and with equal versions every member gets `1/P` (the constant mode).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lightning_prague.core.errors import ConfigurationError


def staleness_weights(versions: Sequence[int], alpha: float = 0.9) -> list[float]:
    """Per-member weights, in the order of `versions`; see the module docstring."""
    if not versions:
        raise ValueError("staleness_weights needs at least one member version")
    if not 0.0 < alpha < 1.0:
        raise ConfigurationError(f"alpha={alpha} is invalid: the staleness decay must be strictly between 0 and 1")
    newest = max(versions)
    staleness = [newest - v + 1 for v in versions]
    levels = max(staleness)
    norm = 1.0 - alpha**levels
    mass = {s: alpha ** (s - 1) * (1.0 - alpha) / norm for s in range(1, levels + 1)}
    count = Counter(staleness)
    mass[1] += sum(m for s, m in mass.items() if count[s] == 0)  # unoccupied levels go to the freshest
    return [mass[s] / count[s] for s in staleness]
