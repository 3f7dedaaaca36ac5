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

Memory: the background exchangers keep flat copies of the averaged state (parameters and
floating-point buffers), allocated once and refreshed in place: the snapshot (the worker's spare
copy, `GroupWorker.spare`, which synchronization points use for the global average) and the change
the averages made (`SnapshotAverages`), plus one bucket once two averages run on one snapshot; where
each snapshot is averaged once (`in_place`: `partial_reduce`, `prague` with `avoid_busy`, both sides
of AD-PSGD) the snapshot becomes its change, one copy and a piece. A step
allocates nothing the size of the model (docs/memory.md has the measurements). On CUDA the threads
run on a stream of their own and hand snapshots and results over with CUDA events
(`lightning_prague.core.comm.streams`): the training thread never synchronises with the device for an
exchange.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_prague.core.comm.averaging import BucketedTensors, SnapshotAverages
from lightning_prague.core.comm.streams import CommStream, Marker
from lightning_prague.core.errors import CoordinationTimeout, ExchangeInterrupted
from lightning_prague.core.exchange.worker import GroupAnswer, GroupWorker

log = logging.getLogger(__name__)
_LEAVE = "leave"  # a job: leave the session from the thread (`GroupWorker.leave`)
#: seconds a leaving rank waits for its communication thread's exchange in flight before it sends its
#: `leave` itself (`BackgroundAverager.leave`)
LEAVE_GRACE_SECONDS = 2.0


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
        #: run by every rank of a replica after each step's exchange work and after each meeting, once
        #: each (`None`: no replica to put together): each rank averages its own slice of a whole model
        #: apart from the others (`GroupWorker.part`), and this gives every rank all the slices again
        #: (`lightning_prague.core.replicas.reassembly`)
        self.reassemble: Callable[[], None] | None = None

    #: the training thread carries out the groups others draw this rank into (no thread does): it
    #: must serve its inbox wherever it waits long between steps (`GroupWorker.serve_inbox`)
    serves_inbox = False

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

    def take_up(self, admission: dict[str, Any]) -> None:
        """On a rank that rejoined: take up the members' counters (its admission item names them)."""

    def serve_while_parked(self) -> None:
        """While the training thread's claim waits at the work queue's end (called at every poll of
        it): run the groups peers drew this rank into, unless a thread of this exchanger runs them. A
        peer's group must not wait for this rank's next step, which comes only once the claim returns."""
        if self.serves_inbox:
            self.worker.serve_inbox()

    def serve(self) -> None:
        """While waiting at a meeting in idle mode: serve the neighbours that still step (one round)."""

    def finish(self, release: dict[str, Any]) -> None:
        """The meeting's release came: end the phase as it says."""

    def close(self) -> None:
        """Stop any thread without raising (teardown)."""

    def leave(self) -> None:
        """Shut down in the middle of a phase (an error): run what peers wait for, then stop.

        Every exchanger leaves through `GroupWorker.leave`, once; subclasses only say what comes
        first (an exchange in flight is finished) and which thread leaves or reads the inbox.
        Afterwards no thread runs and nothing names this rank.
        """
        self.worker.leave()

    def _put_together(self) -> None:
        if self.reassemble is not None:
            self.reassemble()

    def put_together(self) -> None:
        """After a meeting's release: a replica's ranks put their slices together (what `drain` folded in).
        Not in `drain`: a rank waiting there for its replica's other ranks would not serve the groups
        others drew it into until the meeting, and a rank of another replica may be waiting for one of
        those in its own drain (found: four ranks in two replicas, each pair waiting on the other)."""
        self._put_together()

    def _adopt(self, answer: GroupAnswer, reported: int) -> None:
        if answer.version is not None:  # newest version of the group, plus local steps made since reporting
            self.worker.version += max(0, answer.version - reported)


class BlockingExchanger(Exchanger):
    """The training thread requests a group and averages the live model before the next step."""

    serves_inbox = True

    def step(self) -> None:
        reported = self.worker.version
        start = time.monotonic()
        answer = self.worker.partial_sync(version=reported)
        self.wait_seconds += time.monotonic() - start
        self._put_together()
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

    def serve_while_parked(self) -> None:
        # between phases (a fresh joiner's first claim, the first claim after a meeting) no thread runs
        # this rank's groups: the training thread owns the worker then, and a peer's group must not wait
        if not self.running:
            self.worker.serve_inbox()

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
    than computation). The snapshot is the worker's spare copy of the model (`GroupWorker.spare`),
    refreshed in place at each step that starts an exchange; with the change buffer of
    `SnapshotAverages`, two copies of the model in all. `in_place`: this worker is in one group between
    two of its requests (`partial_reduce`'s first-ready groups, AD-PSGD's active workers, `prague` with
    `avoid_busy`: a group drawn for it runs at its next request, which gets none of its own), so each
    snapshot is averaged once, and it becomes its change in place: one copy of the model and a piece.
    """

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float, in_place: bool = False) -> None:
        super().__init__(worker, live, timeout)
        self.in_place = in_place
        self._jobs: queue.Queue[tuple[int, Marker] | str | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._averages: SnapshotAverages | None = None
        self._in_flight = False  # a job was handed to the thread and its result not folded in yet
        self._reported = 0
        self._answer: GroupAnswer | None = None
        self._done: Marker = None  # the exchange's result is ready on the device after this

    def start(self) -> None:
        if not self.running:
            self._jobs = queue.Queue()
        super().start()

    def _snapshots(self) -> SnapshotAverages:
        if self._averages is None:
            self._averages = SnapshotAverages(self.live, self.worker.spare(), self.worker.part, self.in_place)
        return self._averages

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job == _LEAVE:
                self.worker.leave()
                return
            version, ready = job
            try:
                averages = self._snapshots()
                self.streams.wait(ready)  # the snapshot was taken on the compute stream
                self.streams.keep_for(averages.buffers())
                self._answer = self.worker.partial_sync(averages.average, version=version)
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

    def serve_while_parked(self) -> None:
        # the thread reads the inbox only inside this rank's own request (`partial_sync`): one that is
        # idle, waiting for the next step's job, serves nobody, and the training thread, parked in a
        # claim, posts no job, so the thread cannot turn busy meanwhile. A finished exchange not folded
        # in yet keeps its result in `SnapshotAverages.change`; the live average overwrites only the
        # spare copy (its snapshot, taken anew at the next step), once the thread's stream is done with it.
        if not self.busy:
            self.streams.wait(self._done)
            if self.in_place and self._error is None:  # its change is in the spare copy, which the live
                self._fold_in()  # average would overwrite: folded in now, between two steps (an error: at the next)
            self.worker.serve_inbox()

    def _fold_in(self) -> None:
        if not self._in_flight:
            return
        self._in_flight = False
        answer, self._answer = self._answer, None
        self.streams.wait(self._done)  # the compute stream reads the change only once it is written
        self._snapshots().apply()
        if answer is None:
            return
        self._adopt(answer, self._reported)
        if answer.gid is not None:
            self.exchanges += 1

    def step(self) -> None:
        """Fold in a finished exchange and start the next; returns at once if one is still running."""
        if self.busy:
            self._put_together()
            return
        self._raise_pending()
        self._fold_in()
        self._put_together()
        self.start()
        self._snapshots().take()
        self._reported = self.worker.version
        ready = self.streams.mark()
        self._idle.clear()
        self._in_flight = True
        self._jobs.put((self._reported, ready))

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
                f" (it was at {self.worker.doing})"
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
        # the thread finishes the exchange in flight and leaves itself (`GroupWorker.leave`), after
        # its requests, so the coordinator answers every one of them before `left`. An exchange that
        # waits for a group the others cannot join while this rank holds work (they wait for it at the
        # queue's end) ends only once the control plane hears that this rank leaves: after a short
        # grace, the `leave` goes from here (its group request went out before it blocked)
        if self.running:
            self._jobs.put(_LEAVE)
            thread = self._thread
            if thread is not None:
                thread.join(min(self.timeout, LEAVE_GRACE_SECONDS))
                if thread.is_alive():
                    log.debug("rank %d: the communication thread is at %s: leaving from here", self.worker.rank,
                              self.worker.doing)  # fmt: skip
                    self.worker.send_leave()
            self._join("its last exchange before leaving")
            self._raise_pending()
        else:
            super().leave()


class PassiveResponder(_ThreadedExchanger):
    """Answers the exchanges other workers start with this one, from a thread, on the latest snapshot.

    The training thread publishes at every safe point (`_publish`, in place, in the worker's spare copy):
    it folds in what the exchanges changed and takes a new snapshot of the live model, unless the thread
    is averaging it at that moment. The thread executes this rank's inbox in order. With `in_place` (the
    default) each snapshot is averaged once and becomes its change in place (`SnapshotAverages`: one copy
    of the model and a piece); a group that comes before the next safe point published a new snapshot
    waits for it, so an active worker's exchange (in its own thread: its training never waits) waits at
    most one of this worker's steps, and a training thread parked at the work queue's end, draining at a
    synchronization point or leaving publishes while it waits. Without it, a second exchange before the
    next safe point starts from the first one's result (`SnapshotAverages` chains it: the snapshot and
    the change, plus one bucket). `drain` posts a pause marker behind everything already in the inbox,
    so every exchange assigned before the synchronization point is served before the thread ends.
    """

    thread_name = "prague-passive"

    def __init__(self, worker: GroupWorker, live: BucketedTensors, timeout: float, in_place: bool = True) -> None:
        super().__init__(worker, live, timeout)
        self.in_place = in_place
        self._lock = threading.Lock()
        #: notified when a new snapshot is published (or the responder closes)
        self._published = threading.Condition(self._lock)
        self._closing = False
        self._averages: SnapshotAverages | None = None
        self._serving = False  # the thread is averaging the snapshot: the training thread leaves it alone
        self._trained: Marker = None  # the training thread's latest writes to the shared buffers
        self._answered: Marker = None  # the thread's latest writes to them
        self._served = 0

    def _snapshots(self) -> SnapshotAverages:
        if self._averages is None:
            self._averages = SnapshotAverages(self.live, self.worker.spare(), self.worker.part, self.in_place)
        return self._averages

    def _publish(self) -> None:
        """At a safe point: fold in what the exchanges changed, then refresh the snapshot (both under
        the lock, and neither while the thread is averaging it: the next safe point does)."""
        averages = self._snapshots()
        with self._lock:
            if self._serving:
                return
            self.streams.wait(self._answered)  # the thread's last result is written on its stream
            averages.apply()
            averages.take()
            self.exchanges += self._served
            self._served = 0
            self._trained = self.streams.mark()
            self._published.notify_all()

    def start(self) -> None:
        if self.running:
            return
        self._closing = False
        self._publish()
        super().start()

    def _run(self) -> None:
        averages = self._snapshots()
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
                self._await_snapshot(averages, item)
                self._serving = True
                self.streams.wait(self._trained)  # the snapshot was taken on the compute stream
                self.streams.keep_for(averages.buffers())
            served = 0
            try:
                self.worker.execute(item, averages.average)
                served = 1
            finally:
                with self._lock:
                    self._answered = self.streams.mark()
                    self._served += served
                    self._serving = False

    def _await_snapshot(self, averages: SnapshotAverages, item: dict[str, Any]) -> None:
        """(Under the lock.) In place, a snapshot already averaged waits for the next one (`_publish`)."""
        deadline = time.monotonic() + self.timeout
        while self.in_place and averages.changed and not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinationTimeout(
                    f"rank {self.worker.rank}: group {item.get('gid')} waited {self.timeout:.0f}s for this rank's "
                    "next safe point (its snapshot was averaged once already)"
                )
            self._published.wait(min(left, 1.0))
        if self._closing:
            raise ExchangeInterrupted(f"rank {self.worker.rank}: the passive responder closes")

    def _fold_in(self) -> None:
        """Once the thread has ended: fold in what its last exchanges changed."""
        averages = self._snapshots()
        self.streams.wait(self._answered)
        averages.apply()
        self.exchanges += self._served
        self._served = 0

    def _publish_if_averaged(self) -> None:
        """Publish where the thread may wait for it: the snapshot was averaged since the last one (a poll
        that finds nothing to publish copies no model)."""
        averages = self._averages
        if self.in_place and averages is not None and averages.changed:
            self._publish()

    def serve_while_parked(self) -> None:
        # the thread serves the inbox; a snapshot it averaged waits for a new one, published here (the
        # training thread is between two steps, parked in a claim)
        if self.running:
            self._publish_if_averaged()
        else:
            self.worker.serve_inbox()

    def _join_publishing(self, what: str) -> None:
        """Wait for the thread to end (`_join`), publishing meanwhile: the groups before the pause or the
        `left` marker may each wait for a new snapshot."""
        thread = self._thread
        deadline = time.monotonic() + self.timeout
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            self._publish_if_averaged()
            thread.join(0.02)
        self._join(what)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._published.notify_all()
        super().close()

    def step(self) -> None:
        self._raise_pending()
        if self.running:
            self._publish()
        else:
            self._fold_in()
        self._put_together()

    def drain(self) -> None:
        if self.running:
            self.worker.post_pause()
            self._join_publishing("the exchanges assigned before the synchronization point")
        self._raise_pending()
        self._fold_in()

    def leave(self) -> None:
        self.worker.leave(served=self._served_until_left)

    def _served_until_left(self) -> bool:
        """Once `leave` is sent: a running responder serves everything before `left` and ends there
        (wait for it); False if none runs."""
        if not self.running:
            return False
        self._join_publishing("the exchanges assigned before leaving")
        return True
