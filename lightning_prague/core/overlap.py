"""Group averaging in a background thread, overlapped with the next steps' computation.

Blocking Partial All-Reduce makes a worker wait until every member of its group has finished its
own current step. Here the training thread only takes a snapshot of the model at a safe point
(right after an optimizer step) and hands it to a communication thread, which runs the worker's
group protocol on the snapshot while training goes on. At a later safe point the result is folded
in as ``x <- x + (avg(snapshot) - snapshot)`` (AD-PSGD's atomicity trick), so local progress made
during the exchange is kept, and the sum of all replicas is still exactly conserved: every member
adds ``avg - snapshot``, and those differences sum to zero over a group.
"""

from __future__ import annotations

import queue
import threading

import torch

from lightning_prague.core.averaging import BucketedTensors
from lightning_prague.core.errors import CoordinationTimeout
from lightning_prague.core.worker import GroupWorker


class BackgroundAverager:
    """Runs :meth:`GroupWorker.partial_sync` on snapshots in a daemon thread.

    Only one exchange is in flight at a time; a step that finds the previous exchange still
    running does not start another (the worker simply averages less often when communication is
    slower than computation).
    """

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float) -> None:
        self.worker = worker
        self.live = live
        self.timeout = timeout
        self.exchanges = 0
        self._jobs: queue.Queue[BucketedTensors | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._snapshot: BucketedTensors | None = None
        self._original: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"prague-comm-{worker.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self.worker.partial_sync(job)
            except BaseException as err:  # re-raised in the training thread at its next safe point
                self._error = err
            finally:
                self._idle.set()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _fold_in(self) -> None:
        if self._snapshot is None:
            return
        for bucket, averaged, original in zip(self.live.buckets, self._snapshot.tensors, self._original):
            flat = self.live.flat(bucket)
            flat.add_(averaged).sub_(original)
            self.live.unflatten_(bucket, flat)
        self._snapshot = None
        self.exchanges += 1

    def step(self) -> None:
        """Call at a safe point after each local step: fold in a finished exchange, start the next."""
        if self.busy:
            return
        self._raise_pending()
        self._fold_in()
        flats = [self.live.flat(bucket) for bucket in self.live.buckets]
        self._original = [f.clone() for f in flats]
        self._snapshot = BucketedTensors(flats, bucket_bytes=0)  # one flat tensor per bucket, as in ``live``
        self._idle.clear()
        self._jobs.put(self._snapshot)

    def drain(self) -> None:
        """Wait for the exchange in flight and fold it in; afterwards the worker is free to use."""
        if not self._idle.wait(self.timeout):
            raise CoordinationTimeout(
                f"rank {self.worker.rank}: the background group exchange did not finish within {self.timeout:.0f}s"
            )
        self._raise_pending()
        self._fold_in()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(self.timeout)
