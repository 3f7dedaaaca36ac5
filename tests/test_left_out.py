"""Nobody waits for a blocked worker: past its short bound it is left out of the fit (the others go
on without it), it is fenced only at its long bound, and if it wakes before that it comes back in
place. The control plane's side with a fake clock, the worker's side on a real `Session`; the
whole path with real processes is in `tests/test_slow_not_dead.py`."""

from __future__ import annotations

import json
import threading
import types

import pytest
from helpers import CREDENTIALS, run_external_ranks

import lightning_prague.demo.run  # noqa: F401  (imported once here: the ranks are forked from this process)
from lightning_prague.core import ControlPlane, SessionConfig, make_policy
from lightning_prague.core.client.control import Session
from lightning_prague.core.errors import ConfigurationError, FitEnded, LeftOut
from lightning_prague.core.job import RESTARTS_VARIABLE
from lightning_prague.core.plane.liveness import HangDetector
from lightning_prague.core.protocol import LEFT_OUT, HangRule
from lightning_prague.strategies.in_place import MAX_COMEBACKS, EpochMovedOn, RejoinInPlace
from lightning_prague.strategies.options import StrategyOptions
from lightning_prague.strategies.survivors import Survivors

pytestmark = pytest.mark.timeout(60)

WORLD = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stepping(hangs: HangDetector, clock: Clock, ranks, seconds: float, progress: dict[int, int]) -> None:
    """`ranks` beat once a second for `seconds`, each training 20 batches of 50 ms a second."""
    for _ in range(int(seconds)):
        clock.now += 1.0
        for rank in ranks:
            progress[rank] = progress.get(rank, 0) + 20
            hangs.beat(rank, progress[rank], waiting=False, busy=False, step=0.05)


def test_the_short_bound_is_10s_for_short_steps_follows_long_steps_and_never_passes_the_long_one():
    rule = HangRule()
    assert rule.leave_out_bound(0.05, busy=False, timeout=300.0) == 10.0
    assert rule.leave_out_bound(2.0, busy=False, timeout=300.0) == 40.0  # 20 x a slow step
    # not shorter than the long bound: fenced then, without a stay left out
    assert rule.leave_out_bound(5.0, busy=False, timeout=300.0) is None and rule.bound(5.0, False, 300.0) == 100.0
    assert HangRule(floor=4.0).leave_out_bound(0.05, busy=False, timeout=300.0) is None
    assert HangRule(floor=4.0, leave_out_floor=1.5).leave_out_bound(0.05, busy=False, timeout=300.0) == 1.5
    assert rule.leave_out_bound(0.05, busy=True, timeout=300.0) is None  # a checkpoint, an epoch's end
    assert rule.leave_out_bound(None, busy=False, timeout=300.0) is None  # a first step that compiles
    with pytest.raises(ConfigurationError, match="leave_out_after=0"):
        StrategyOptions(leave_out_after=0)
    assert StrategyOptions(leave_out_after=3.0).hang_rule.leave_out_floor == 3.0


def test_a_blocked_worker_is_left_out_once_at_its_short_bound_and_fenced_at_its_long_one():
    clock = Clock()
    hangs = HangDetector(HangRule(), 300.0, clock=clock)
    for rank in range(WORLD):
        hangs.joined(rank)
    progress: dict[int, int] = {}
    stepping(hangs, clock, range(WORLD), 5, progress)
    # rank 2 blocks: its beacon beats, but it neither progresses nor shows a sign of life
    for second in range(70):
        clock.now += 1.0
        for rank in range(WORLD):
            if rank != 2:
                progress[rank] += 20
            hangs.beat(rank, progress[rank], waiting=False, busy=False, step=0.05)
        out, hung = hangs.left_out(), hangs.hung()
        if second < 9:
            assert out == [] and hung == [], second
        elif second == 10:
            assert [rank for rank, _ in out] == [2] and out[0][1].startswith(LEFT_OUT), out
        elif second < 59:
            assert out == [] and hung == [], second  # reported once; not fenced before its long bound
        if hung:
            assert [rank for rank, _ in hung] == [2] and second >= 59, (second, hung)
            break
    else:
        pytest.fail("the blocked rank was never fenced")


def test_a_busy_a_computing_and_a_silent_worker_are_not_left_out():
    clock = Clock()
    hangs = HangDetector(HangRule(), 300.0, clock=clock)
    for rank in range(3):
        hangs.joined(rank)
    progress: dict[int, int] = {}
    stepping(hangs, clock, range(3), 3, progress)
    for _ in range(20):
        clock.now += 1.0
        hangs.beat(0, progress[0], waiting=False, busy=True, step=0.05)  # a checkpoint: the long bound only
        hangs.beat(1, progress[1], waiting=False, busy=False, step=0.05, active=True)  # computes: slow
        # rank 2 is silent (SIGSTOP): its silence bound (10 s) fences it, without a stay left out
        assert hangs.left_out() == []
    assert [rank for rank, _ in hangs.hung()] == [2]


def config_wire() -> dict:
    return SessionConfig(WORLD, make_policy("random", WORLD, 2, seed=1).spec()).to_wire()


def send(plane: ControlPlane, rank: int, op: str, **fields) -> dict:
    return plane.handle({"op": op, "s": 1, "rank": rank, **fields})


@pytest.fixture
def plane() -> tuple[ControlPlane, Clock]:
    """A fit of 4 ranks stepping 50 ms batches, on a fake clock; nothing can be fenced here (the
    processes are on another host), so a fence is a `fenced` item."""
    plane, clock = ControlPlane(), Clock()
    for rank in range(WORLD):
        send(plane, rank, "join", config=config_wire(), pid=1000 + rank, host="elsewhere")
    hangs = plane.sessions[1].hangs
    hangs.clock = clock
    for rank in range(WORLD):
        hangs.joined(rank)
    return plane, clock


def beat_all(plane: ControlPlane, clock: Clock, seconds: int, blocked=(), progress: dict | None = None) -> dict:
    """Every rank beats once a second for `seconds`, those not `blocked` progressing; the ticks' items."""
    progress = progress if progress is not None else {}
    out: dict = {}
    for _ in range(seconds):
        clock.now += 1.0
        for rank in range(WORLD):
            if rank not in blocked:
                progress[rank] = progress.get(rank, 0) + 20
            send(plane, rank, "beat", progress=progress.get(rank, 0), waiting=False, busy=False, step=0.05)
        for rank, items in plane.tick().items():
            out.setdefault(rank, []).extend(items)
    return out


def test_the_others_go_on_without_a_left_out_rank_whose_work_goes_back_and_who_is_told(plane):
    plane, clock = plane
    session = plane.sessions[1]
    progress: dict = {}
    beat_all(plane, clock, 3, progress=progress)
    held = send(plane, 2, "kv", req=1, do="claim", key="queue@0", first=0, num=8)[2][0]["value"][0]
    out = beat_all(plane, clock, 12, blocked={2}, progress=progress)
    assert 2 in session.departed and 2 not in session.members and 2 in session.left_out
    for rank in (0, 1, 3):  # a departure, as for a lost rank: they go on without it
        assert any(i["t"] == "departed" and i["rank"] == 2 for i in out[rank]), out[rank]
    assert [i["t"] for i in out[2] if i["t"] in ("left_out", "fenced")] == ["left_out"]  # told, not fenced
    assert session.values["queue@0/requeued"] == [[held, None]]  # its chunk is trained by the others
    # it wakes: its late report takes nothing, and its leave and close end its watch (no fence later)
    assert send(plane, 2, "work", key="queue@0", done=[held]) == {}
    send(plane, 2, "close", failed=True)
    assert 2 not in session.left_out
    out = beat_all(plane, clock, 70, progress=progress)
    assert not any(i["t"] == "fenced" for i in out.get(2, []))


def test_a_left_out_rank_that_never_wakes_is_fenced_at_its_long_bound_after_the_fit_ended(plane):
    plane, clock = plane
    session = plane.sessions[1]
    progress: dict = {}
    beat_all(plane, clock, 3, progress=progress)
    beat_all(plane, clock, 12, blocked={2}, progress=progress)
    out: dict = {}
    for rank in (0, 1, 3):  # the others finish the fit while rank 2 is left out
        for r, items in send(plane, rank, "close").items():
            out.setdefault(r, []).extend(items)
    assert [i["t"] for i in out[2]] == ["fit_ended"]  # its fit ends when it wakes
    assert plane.sessions.get(1) is session  # kept, to fence it at its bound
    for _ in range(50):  # its beacon still beats; the others' processes run on after their fits
        clock.now += 1.0
        send(plane, 2, "beat", progress=20 * 3, waiting=False, busy=False, step=0.05)
        for rank, items in plane.tick().items():
            out.setdefault(rank, []).extend(items)
    fenced = [(rank, i["reason"]) for rank, items in out.items() for i in items if i["t"] == "fenced"]
    assert [rank for rank, _ in fenced] == [2] and "no sign of life for 6" in fenced[0][1], fenced
    assert 1 not in plane.sessions  # then the session is over


def test_a_left_out_rank_that_wakes_asks_to_rejoin_and_is_admitted_at_once(plane):
    plane, clock = plane
    session = plane.sessions[1]
    beat_all(plane, clock, 3)
    beat_all(plane, clock, 12, blocked={2})
    send(plane, 2, "leave")
    send(plane, 2, "close", failed=True)
    out = send(plane, 2, "join", config=config_wire(), pid=1002, host="elsewhere", rejoin=True)
    assert 2 in session.generator.live and 2 in session.members and 2 not in session.left_out
    assert all(any(i["t"] == "members" for i in out[rank]) for rank in (0, 1, 3)), out
    assert [i["t"] for i in out[2]] == ["admit"]


def test_a_left_out_worker_drops_its_groups_connections_and_raises_left_out_at_its_next_contact_and_in_any_wait():
    dropped: list[str] = []
    client = types.SimpleNamespace(
        rank=2, timeout=5.0, closed=False, credentials=CREDENTIALS, on_left_out=lambda: dropped.append("group")
    )
    session = Session(client, 1, WORLD)  # type: ignore[arg-type]
    session.raise_if_cut_off()  # nothing yet
    waiting: list[BaseException] = []

    def wait_for_verdict() -> None:
        try:
            session._verdicts.clear()
            with session._verdict_ready:
                while "g1" not in session._verdicts:
                    if session.left_out is not None:
                        raise session.left_out_error("the verdict on group average #1")
                    session._verdict_ready.wait(5.0)
        except LeftOut as err:
            waiting.append(err)

    thread = threading.Thread(target=wait_for_verdict)
    thread.start()
    session.deliver({"t": "left_out", "reason": f"{LEFT_OUT}: no sign of life for 10.3s", "s": 1})
    thread.join(5.0)
    assert waiting and "left this rank out" in str(waiting[0]) and "10.3s" in str(waiting[0])
    assert dropped == ["group"]  # its peers' exchanges with it end now, as if it had ended
    with pytest.raises(LeftOut, match="during a training batch"):
        session.raise_if_cut_off("a training batch")
    for _ in range(2):  # every later wait on the inbox ends too
        with pytest.raises(LeftOut):
            session.receive(1.0)
    session.deliver({"t": "fit_ended", "s": 1})
    assert session.fit_ended


def test_a_rank_left_out_for_a_while_that_came_back_is_no_lost_worker():
    session = types.SimpleNamespace(
        departed={3: "its process ended"},
        departed_at={3: 1.0},
        rejoined={2: (2.0, f"{LEFT_OUT}: no sign of life for 10.3s")},
        members=[0, 1, 2],
    )
    strategy = types.SimpleNamespace(
        session=session, lost_workers={}, is_global_zero=False, strategy_name="prague", min_workers=1
    )
    Survivors(strategy).report_losses()  # type: ignore[arg-type]
    assert list(strategy.lost_workers) == [3]


class _Strategy:
    """What `RejoinInPlace` uses of a strategy: its session's left-out reason, the failed attempt's end,
    and the comeback (which clears the reason and counts)."""

    def __init__(self, left_out: str | None) -> None:
        self.session = types.SimpleNamespace(left_out=left_out, fit_ended=False)
        self.exceptions: list[BaseException] = []
        self.comebacks = 0

    def on_exception(self, error: BaseException) -> None:
        self.exceptions.append(error)

    def leave_in_place(self) -> None:
        self.session = types.SimpleNamespace(left_out=None, fit_ended=False)
        self.comebacks += 1


def _trainer(strategy: _Strategy, calls: list[object]) -> types.SimpleNamespace:
    trainer = types.SimpleNamespace(strategy=strategy, global_rank=2, training=False, should_stop=True)
    trainer._teardown = lambda: calls.append("teardown")
    return trainer


def test_rejoin_in_place_runs_the_fit_again_from_a_peer_only_when_left_out():
    calls: list[object] = []
    trainer = _trainer(_Strategy(f"{LEFT_OUT}: blocked"), calls)

    def fit(model: object, ckpt_path: object = None) -> str:
        calls.append(ckpt_path)
        if len(calls) == 1:
            raise LeftOut("rank 2: left out")
        return "done"

    assert RejoinInPlace(fit, trainer)("model") == "done"
    assert calls == [None, "teardown", "lightning-prague://peer"]
    assert trainer.training is True and trainer.should_stop is False

    def failing(model: object, ckpt_path: object = None) -> str:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):  # not left out: the error stands
        RejoinInPlace(failing, trainer)("model")


def test_a_lock_step_joiner_admitted_as_its_epoch_ended_leaves_and_asks_again(monkeypatch):
    """A lock-step rank admitted inside epoch e whose donor's state is of e + 1 (`EpochMovedOn`) is not
    done with the fit: it leaves (its attempt ends as a failed one, so the plane departs it) and asks
    again as a joiner, up to `MAX_COMEBACKS` times; it was once a fit that ended on 3 ranks."""
    calls: list[object] = []
    trainer = _trainer(_Strategy(None), calls)

    def fit(model: object, ckpt_path: object = None) -> str:
        calls.append(ckpt_path)
        if len(calls) == 1:
            raise EpochMovedOn("rank 2 stood in epoch 1 and the others are in epoch 2")
        return "done"

    assert RejoinInPlace(fit, trainer)("model", ckpt_path="lightning-prague://peer") == "done"
    assert calls == ["lightning-prague://peer", "teardown", "lightning-prague://peer"]
    assert trainer.strategy.comebacks == 1 and isinstance(trainer.strategy.exceptions[0], EpochMovedOn)

    def always_moved_on(model: object, ckpt_path: object = None) -> str:
        raise EpochMovedOn("rank 2 stood in epoch 1 and the others are in epoch 2")

    trainer.strategy = _Strategy(None)
    with pytest.raises(EpochMovedOn):  # bounded: the last one ends the fit with its error
        RejoinInPlace(always_moved_on, trainer)("model")
    assert trainer.strategy.comebacks == MAX_COMEBACKS

    attempts: list[object] = []

    def ended_meanwhile(model: object, ckpt_path: object = None) -> str:
        attempts.append(ckpt_path)
        if len(attempts) == 1:
            raise EpochMovedOn("rank 2 stood in epoch 1 and the others are in epoch 2")
        raise FitEnded("rank 2 cannot rejoin fit 1: the fit ended")

    # the others finished the fit before it was admitted again: its fit ends without an error, even in the
    # process its launcher started first (a process started by hand to rejoin a fit raises `FitEnded`)
    monkeypatch.delenv(RESTARTS_VARIABLE, raising=False)
    trainer.strategy = _Strategy(None)
    assert RejoinInPlace(ended_meanwhile, trainer)("model") is None
    assert len(attempts) == 2 and trainer.strategy.comebacks == 1


@pytest.mark.timeout(200)
def test_a_blocked_worker_is_left_out_and_comes_back_in_place_and_a_hung_one_is_fenced_at_its_long_bound(tmp_path):
    """Real processes, the bounds scaled down (left out after 1.5 s, fenced after 8 s): rank 1 blocks
    for 4 s in a step, rank 2 for ever. The others go on without both; rank 1 wakes, comes back in
    place (no new process, no fence) and trains on; rank 2 is fenced at its long bound."""
    args = ["--strategy", "prague", "--epochs", "2", "--batch-size", "4", "--step-time", "0.05"]
    args += ["--hang-timeout", "8", "--leave-out-after", "1.5", "--fault", "1:5:block=4", "--fault", "2:8:hang"]
    # the short bound is at least `hang_factor` times a rank's longest recent step: at the default 20, a
    # machine loaded enough to stretch a 0.05 s step to 0.27 s (another test's job beside this one) made
    # it 5.5 s, longer than the 4 s block, and rank 1 was never left out. At 4 it stays at its 1.5 s floor
    # up to steps of 0.37 s, and under 4 s up to 1 s
    args += ["--hang-factor", "4"]
    codes, logs = run_external_ranks(tmp_path, WORLD, *args, timeout=150)
    assert codes[2] == -9 and [codes[r] for r in (0, 1, 3)] == [0, 0, 0], (codes, logs[1][-3000:])
    results = {0: json.loads((tmp_path / "result.json").read_text())}
    results.update({r: json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in (1, 3)})
    for rank in (0, 3):  # rank 2 was lost; rank 1 was only left out for a while
        lost = results[rank]["lost_workers"]
        assert list(lost) == ["2"] and lost["2"]["why"].startswith(LEFT_OUT), (rank, lost)
    assert set(results[1]["lost_workers"]) <= {"2"}  # (it came back after rank 2 had left)
    assert "it rejoins the fit in place" in logs[1] and "rejoined the job inside the epoch" in logs[1], logs[1][-3000:]
    assert results[1]["batches_this_process"] > 5  # it trained on after the step that blocked
    assert len({result["params_sha256"] for result in results.values()}) == 1  # one model at the end


@pytest.mark.timeout(200)
def test_a_lock_step_rank_that_wakes_in_a_later_epoch_comes_back_in_place_at_an_epoch_end(tmp_path):
    """`decent_adam` (lock-step shards), 6 short epochs, rank 1 blocked for 9 s at its 3rd batch: left out
    after 1.5 s, it wakes epochs later, when its shard holds nothing of the others' epoch. It comes back
    in place (no new process, no fence) and is admitted at their epoch's end, not inside it; every rank
    finishes every epoch with one model, and nobody counts it lost."""
    args = ["--strategy", "decent_adam", "--epochs", "6", "--batch-size", "32", "--step-time", "0.05"]
    args += ["--hang-timeout", "20", "--leave-out-after", "1.5", "--fault", "1:3:block=9"]
    codes, logs = run_external_ranks(tmp_path, WORLD, *args, timeout=150)
    assert codes == [0] * WORLD, (codes, logs[1][-3000:])
    results = {0: json.loads((tmp_path / "result.json").read_text())}
    results.update({r: json.loads((tmp_path / f"result.rank{r}.json").read_text()) for r in range(1, WORLD)})
    assert "it rejoins the fit in place" in logs[1], logs[1][-3000:]
    assert "rejoined the job at 'epoch_end@epoch" in logs[1], logs[1][-3000:]  # at an epoch's end
    assert all(result["epochs_run"] == 6 for result in results.values()), results
    assert len({result["params_sha256"] for result in results.values()}) == 1  # one model at the end
    assert all(not result["lost_workers"] for result in results.values())  # only left out for a while
    assert results[1]["batches_this_process"] > 12  # it trained whole epochs after it woke
