"""How a worker's group exchanges run relative to its training steps.

Every strategy calls an *exchanger* at the same points of the training loop: `start` when
an asynchronous phase begins, `step` at the safe point after each local optimizer step,
`drain` at a synchronization point (afterwards nothing is in flight and no thread runs),
and `close` at teardown, also after an exception.

* `BlockingExchanger` - the exchange runs in the training thread (Prague's paper).
* `BackgroundAverager` - the worker's own requests run on a snapshot in a communication
  thread while the next steps compute (Prague with `overlap`, Partial Reduce, AD-PSGD's active
  workers).
* `PassiveResponder` - a thread answers exchanges other workers start (AD-PSGD's passive
  workers) on the latest published snapshot.

The background ones keep AD-PSGD's atomicity without stopping compute: an exchange averages a
snapshot `s` and the training thread later folds in `x <- x + (avg(s) - s)`, so local progress
made during the exchange is kept and each exchange is applied exactly once. Under plain means the
differences sum to zero over a group, so the sum of all replicas is conserved.

Memory: a background exchange holds the snapshot and a copy of it as it was taken, two extra
copies of the averaged state (parameters and floating-point buffers), and, while its group
average runs, the sums of every bucket and float64 temporaries: 4.5 copies at its peak as
measured (`benchmarks/memory.py`, docs/memory.md, which also says what would remove them). On
CUDA the threads run on a stream of their own and hand snapshots and results over with CUDA
events (`lightning_prague.core.streams`): the training thread never synchronises with the device
for an exchange.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from lightning_prague.core.averaging import BucketedTensors
from lightning_prague.core.errors import CoordinationTimeout, ExchangeInterrupted
from lightning_prague.core.streams import CommStream, Marker
from lightning_prague.core.worker import GroupAnswer, GroupWorker

log = logging.getLogger(__name__)
_LEAVE = "leave"  # a job: send `leave` and serve what is assigned until `left`


def communication_threads() -> list[str]:
    """Names of this process's exchange threads now alive (not the control connection's reader, which
    lives as long as the process): after a synchronization point or teardown there must be none."""
    return [t.name for t in threading.enumerate() if t.name.startswith("prague-") and "control" not in t.name]


class Exchanger:
    """The interface every strategy drives; see the module docstring."""

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float) -> None:
        self.worker = worker
        self.live = live
        self.timeout = timeout
        self.exchanges = 0  # exchanges folded into the live model
        #: seconds the training thread spent blocked on exchanges (not hidden behind computation)
        self.wait_seconds = 0.0
        #: the stream communication threads run on, and the events that order it against compute
        self.streams = CommStream(live.device)

    def start(self) -> None:
        """An asynchronous phase begins (idempotent)."""

    def step(self) -> None:
        """Safe point after a local optimizer step."""
        raise NotImplementedError

    def drain(self) -> None:
        """Finish and fold in whatever is in flight; afterwards the worker belongs to the training thread."""

    # -- the meeting that ends a phase (`GroupWorker.synchronize`) ------------------------------
    #: seconds a rank waits at a meeting before it asks for idle rounds (`None`: it never serves)
    idle_after: float | None = None

    def meeting_report(self) -> dict[str, Any]:
        """What this rank tells the coordinator when it arrives at a meeting."""
        return {}

    def serve(self) -> None:
        """While waiting at a meeting in idle mode: serve the neighbours that still step (one round)."""

    def finish(self, release: dict[str, Any]) -> None:
        """The meeting's release came: end the phase as it says."""

    def close(self) -> None:
        """Stop any thread without raising (teardown)."""

    def leave(self) -> None:
        """Shut down in the middle of a phase (an error): run what peers wait for, then stop.

        See `GroupWorker.await_left`; afterwards no thread runs and nothing names this rank.
        """
        self.worker.send_leave()
        self.worker.await_left()

    def _adopt(self, answer: GroupAnswer, reported: int) -> None:
        if answer.version is not None:  # newest version of the group, plus local steps made since reporting
            self.worker.version += max(0, answer.version - reported)


class BlockingExchanger(Exchanger):
    """The training thread requests a group and averages the live model before the next step."""

    def step(self) -> None:
        reported = self.worker.version
        start = time.monotonic()
        answer = self.worker.partial_sync(version=reported)
        self.wait_seconds += time.monotonic() - start
        self._adopt(answer, reported)
        if answer.gid is not None:
            self.exchanges += 1


class _ThreadedExchanger(Exchanger):
    """Owns one communication thread per asynchronous phase and the fold-in of its results."""

    thread_name = "prague-comm"

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float) -> None:
        super().__init__(worker, live, timeout)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._raise_pending()  # an error of the previous thread surfaces here, never silently dropped
        self._thread = threading.Thread(
            target=self._guarded, name=f"{self.thread_name}-{self.worker.rank}", daemon=True
        )
        self._thread.start()

    def _guarded(self) -> None:
        try:
            self.streams.bind()
            self._run()
        except ExchangeInterrupted:
            pass
        except BaseException as err:  # re-raised in the training thread at its next safe point
            self._error = err

    def _run(self) -> None:
        raise NotImplementedError

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _join(self, what: str) -> None:
        if self._thread is None:
            return
        self._thread.join(self.timeout)
        if self._thread.is_alive():
            raise CoordinationTimeout(
                f"rank {self.worker.rank}: the communication thread did not finish {what} within {self.timeout:.0f}s"
            )
        self._thread = None

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None or not thread.is_alive():
            return
        self._interrupt()
        thread.join(min(self.timeout, 10.0))
        if thread.is_alive():  # blocked inside a collective with a dead peer; it ends at that collective's timeout
            log.warning("rank %d: %s is still blocked in an exchange at teardown", self.worker.rank, thread.name)

    def _interrupt(self) -> None:
        try:
            self.worker.post_pause()
        except Exception:  # the store may be gone already
            log.debug("could not interrupt the communication thread", exc_info=True)


class BackgroundAverager(_ThreadedExchanger):
    """Runs the worker's own group requests on snapshots in a communication thread.

    Only one exchange is in flight at a time; a step that finds the previous exchange still
    running does not start another (the worker averages less often when communication is slower
    than computation).
    """

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float) -> None:
        super().__init__(worker, live, timeout)
        self._jobs: queue.Queue[tuple[BucketedTensors, int, Marker] | str | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._snapshot: BucketedTensors | None = None
        self._original: list[torch.Tensor] = []
        self._reported = 0
        self._answer: GroupAnswer | None = None
        self._done: Marker = None  # the exchange's result is ready on the device after this

    def start(self) -> None:
        if not self.running:
            self._jobs = queue.Queue()
        super().start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job is _LEAVE:
                self.worker.leave()
                return
            snapshot, version, ready = job
            try:
                self.streams.wait(ready)  # the snapshot was taken on the compute stream
                self.streams.keep_for(snapshot.tensors)
                self._answer = self.worker.partial_sync(snapshot, version=version)
                self._done = self.streams.mark()
            except ExchangeInterrupted:
                raise
            except BaseException as err:
                self._error = err  # stored before the training thread can see the exchange as finished
                raise
            finally:
                self._idle.set()

    @property
    def busy(self) -> bool:
        """An exchange is in flight (a thread that died with a job queued is not busy: its error is due)."""
        return not self._idle.is_set() and self.running

    def _fold_in(self) -> None:
        snapshot, self._snapshot = self._snapshot, None
        answer, self._answer = self._answer, None
        if snapshot is None or answer is None:
            return
        self.streams.wait(self._done)  # the compute stream reads the average only once it is written
        for bucket, averaged, original in zip(self.live.buckets, snapshot.tensors, self._original):
            flat = self.live.flat(bucket)
            flat.add_(averaged).sub_(original)
            self.live.unflatten_(bucket, flat)
        self._adopt(answer, self._reported)
        if answer.gid is not None:
            self.exchanges += 1

    def step(self) -> None:
        """Fold in a finished exchange and start the next; returns at once if one is still running."""
        if self.busy:
            return
        self._raise_pending()
        self._fold_in()
        self.start()
        flats = [self.live.flat(bucket) for bucket in self.live.buckets]
        self._original = [f.clone() for f in flats]
        self._snapshot = BucketedTensors(flats, bucket_bytes=0)  # one flat tensor per bucket, as in `live`
        self._reported = self.worker.version
        ready = self.streams.mark()
        self._idle.clear()
        self._jobs.put((self._snapshot, self._reported, ready))

    def drain(self) -> None:
        start = time.monotonic()
        deadline = start + self.timeout
        while self.busy and time.monotonic() < deadline:
            self._idle.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        self.wait_seconds += time.monotonic() - start
        self._raise_pending()  # the thread's own error, as it was raised, before any timeout
        if self.busy:
            raise CoordinationTimeout(
                f"rank {self.worker.rank}: the background group exchange did not finish within {self.timeout:.0f}s"
            )
        self._fold_in()
        if self._thread is not None:
            self._jobs.put(None)
            self._join("its last exchange")

    def close(self) -> None:
        if self.running and not self.busy:
            self._jobs.put(None)  # idle: a sentinel ends it at once
        super().close()
        self._idle.set()

    def leave(self) -> None:
        # the thread finishes the exchange in flight and sends `leave` itself: on the connection
        # that carried its requests, so the coordinator answers every one of them before `left`
        if self.running:
            self._jobs.put(_LEAVE)
            self._join("its last exchange before leaving")
            self._raise_pending()
        else:
            super().leave()


class PassiveResponder(_ThreadedExchanger):
    """Answers the exchanges other workers start with this one, from a thread, on the latest snapshot.

    The training thread publishes a snapshot of the live model at every safe point. The thread
    executes this rank's inbox in order; for each group it averages the published snapshot in
    place, adds `avg - before` to a pending difference, and keeps any newer published snapshot
    consistent with it. At the next safe point the pending difference is folded into the live
    model. `drain` posts a pause marker behind everything already in the inbox, so every
    exchange assigned before the synchronization point is served before the thread ends.
    """

    thread_name = "prague-passive"

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float) -> None:
        super().__init__(worker, live, timeout)
        self._lock = threading.Lock()
        self._published: BucketedTensors | None = None
        self._published_ready: Marker = None
        self._pending: list[torch.Tensor] | None = None
        self._pending_done: Marker = None
        self._served = 0

    def _publish(self) -> None:
        flats = [self.live.flat(bucket) for bucket in self.live.buckets]
        ready = self.streams.mark()
        with self._lock:
            self._published = BucketedTensors(flats, bucket_bytes=0)
            self._published_ready = ready

    def start(self) -> None:
        if self.running:
            return
        self._publish()
        super().start()

    def _run(self) -> None:
        while True:
            item = self.worker.poll_item()
            if item is None:
                continue  # nobody exchanged with us for a while: keep listening
            if item["t"] in ("pause", "left"):
                return
            if item["t"] != "group":
                self.worker.execute(item)
                continue
            with self._lock:
                snapshot, ready = self._published, self._published_ready
            assert snapshot is not None
            self.streams.wait(ready)
            self.streams.keep_for(snapshot.tensors)  # the training thread may publish a newer one and drop it
            before = [t.clone() for t in snapshot.tensors]
            self.worker.execute(item, snapshot)
            with self._lock:
                delta = [after - b for after, b in zip(snapshot.tensors, before)]
                if self._pending is None:
                    self._pending = delta
                else:
                    for p, d in zip(self._pending, delta):
                        p.add_(d)
                if self._published is not snapshot and self._published is not None:
                    self.streams.wait(self._published_ready)
                    self.streams.keep_for(self._published.tensors)
                    for t, d in zip(self._published.tensors, delta):
                        t.add_(d)
                self._pending_done = self.streams.mark()
                self._served += 1

    def _fold_in(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            served, self._served = self._served, 0
            done = self._pending_done
        if pending is not None:
            self.streams.wait(done)
            self.streams.keep_for(pending)  # made on the communication stream, dropped right here
            for bucket, d in zip(self.live.buckets, pending):
                flat = self.live.flat(bucket)
                flat.add_(d)
                self.live.unflatten_(bucket, flat)
        self.exchanges += served

    def step(self) -> None:
        self._raise_pending()
        self._fold_in()
        if self.running:
            self._publish()

    def drain(self) -> None:
        if self.running:
            self.worker.post_pause()
            self._join("the exchanges assigned before the synchronization point")
        self._raise_pending()
        self._fold_in()

    def leave(self) -> None:
        self.worker.send_leave()
        if self.running:  # the responder serves everything before `left` and ends there
            self._join("the exchanges assigned before leaving")
        else:
            self.worker.await_left()
