"""What in this process a forked child could not use, or would hang on when it exits.

The library forks in two places: a rank's keeper forks the rank's training process
(`lightning_prague.strategies.launcher.keep_this_rank`), and rank 0 forks the supervisor
(`lightning_prague.core.plane.launch`). Both fall back to starting a fresh interpreter where a fork
would inherit process-wide native state that does not survive it:

- **CUDA**, once initialised: a forked child cannot use it.
- **An MPI library**, once initialised through `mpi4py` (Lightning's `MPIEnvironment.detect()`
  imports `mpi4py.MPI`, which initialises MPI, wherever `mpi4py` is installed and no SLURM or
  torchrun variables are set: a Kubernetes pod, a job started with Lightning's own variables). A
  forked child that exits normally runs MPI's finalisation, which waits for a peer that is not there:
  seen with Open MPI 5, the training process of a finished fit never exited.

Standard library only, and nothing is imported: a library the process has not loaded holds no state.
"""

from __future__ import annotations

import sys
from typing import Optional

__all__ = ["cuda_initialized", "mpi_initialized", "unforkable_state"]


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (a forked child could not use it)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def mpi_initialized() -> bool:
    """Whether `mpi4py` has initialised an MPI library in this process and not finalised it yet."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        return bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())
    except Exception:  # a stand-in or a broken install: nothing we can tell, so nothing to avoid
        return False


def unforkable_state() -> Optional[str]:
    """What in this process a forked child could not use or would hang on at its exit, in words, or
    `None` where a fork is safe."""
    if cuda_initialized():
        return "CUDA is initialised"
    if mpi_initialized():
        return "an MPI library is initialised (mpi4py, which Lightning's MPI detection imports)"
    return None
