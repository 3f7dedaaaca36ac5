"""Losing the control plane for good (`LIGHTNING_PRAGUE_PLANE_WAIT=0`: no rank waits for it to come
back; `test_plane_restart.py` has one that does): every rank's fit fails with `ControlPlaneError` through Lightning's
`on_exception` (an `OnExceptionCheckpoint` writes its checkpoint), and a rank whose training thread
never gets to the plane again (stuck in an exchange with a peer) still ends itself.

The supervisor process is SIGKILLed mid-fit, for real (`scripts/plane_loss.py`,
`scripts/plane_loss_core.py`); the cut-off rules themselves are checked on a session in this process.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
import types

import pytest
import torch
from helpers import SCRIPTS, _run_script_in_child, _start_forked, env, free_port, run_script_ranks, run_training

import lightning_prague.demo.run  # noqa: F401  (imported once here: the ranks are forked from this process)
from lightning_prague.core.client import partition
from lightning_prague.core.client.beacon import Beacon
from lightning_prague.core.client.control import Session
from lightning_prague.core.errors import ControlPlaneError, ControlPlaneLost, CoordinationTimeout
from lightning_prague.core.job import PLANE_WAIT_VARIABLE
from lightning_prague.core.protocol import HangRule

pytestmark = pytest.mark.timeout(120)


def run_ranks(tmp, world: int, script: str, argv: list[str], timeout: float = 90) -> tuple[list, list[str]]:
    """``scripts/<script>`` as ``world`` ranks started as a cluster launcher would (`run_script_ranks`)."""
    return run_script_ranks(tmp, world, script, argv, timeout)


# -- the whole fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy",
    [
        "decent_adam",
        "prague",
    ],
)
def test_a_lost_supervisor_fails_every_fit_with_control_plane_error_and_the_exception_checkpoint_is_written(
    tmp_path, strategy, monkeypatch
):
    monkeypatch.setenv(PLANE_WAIT_VARIABLE, "0")  # the forked ranks inherit it: rank 0 starts no supervisor again
    checkpoints = tmp_path / "on_exception"
    argv = ["--strategy", strategy, "--epochs", "50", "--step-time", "0.02", "--group-size", "2", "--devices", "2"]
    argv += ["--json", str(tmp_path / "result.json"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    argv += ["--kill-plane-batch", "5", "--exception-checkpoint", str(checkpoints)]
    start = time.time()
    codes, logs = run_ranks(tmp_path, 2, "plane_loss.py", argv)
    assert codes == [3, 3], (codes, logs[0][-3000:], logs[1][-3000:])  # the fit raised on both
    killed = json.loads((tmp_path / "plane_killed.json").read_text())["time"]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"result.rank{rank}.json").read_text())
        assert report["control_plane_error"] and report["type"] == "ControlPlaneLost", report["error"]
        assert report["on_exception"] == "ControlPlaneLost"  # Lightning's hooks ran with it
        assert f"rank {rank}: the control plane at" in report["error"] and "closed the connection" in report["error"]
        assert "the job cannot go on without its control plane" in report["error"]
        assert report["time"] - killed < 10, "at the next contact with the plane, not at a timeout"
    (written,) = checkpoints.glob("*.ckpt")  # rank 0's, as Lightning writes checkpoints
    assert written.stat().st_mtime >= killed - 1
    checkpoint = torch.load(written, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] > 0 and checkpoint["state_dict"]
    assert time.time() - start < 60


def test_a_rank_stuck_in_an_exchange_when_the_plane_is_lost_ends_itself(tmp_path, monkeypatch):
    monkeypatch.setenv(PLANE_WAIT_VARIABLE, "0")
    # rank 0 waits in a sum that rank 1 never joins (as a peer across a partition), rank 1 sleeps:
    # neither training thread contacts the plane again, so the last resort ends both processes
    port = free_port()
    ctx = multiprocessing.get_context("fork")
    environ = env()
    procs = [
        ctx.Process(
            target=_run_script_in_child,
            args=(
                SCRIPTS / "plane_loss_core.py",
                [str(r), "2", str(port), str(tmp_path / f"r{r}.json")],
                environ,
                tmp_path / f"r{r}.log",
            ),
        )
        for r in range(2)
    ]
    _start_forked(procs)
    for p in procs:
        p.join(60)
    ended = time.time()
    for p in procs:
        if p.is_alive():
            p.kill()
    logs = [(tmp_path / f"r{r}.log").read_text() for r in range(2)]
    assert [p.exitcode for p in procs] == [partition.FENCED_EXIT_STATUS] * 2, logs
    killed = json.loads((tmp_path / "plane_killed.json").read_text())["time"]
    # ended by the last resort (its bound is 2 s, and a few checks of the watch thread), not by the sum's own
    # 60 s timeout: a bound that tells the two apart without counting on this machine's speed
    assert ended - killed < 30, ended - killed
    for rank, log in enumerate(logs):
        assert f"lightning_prague: rank {rank}: the control plane at" in log and "closed the connection" in log
        assert "did not get to a contact with the control plane" in log and "exit status 75" in log
    assert not any((tmp_path / f"r{r}.json").exists() for r in range(2))


# -- the rules, on a session in this process ------------------------------------------------------
class FakeLink:
    def __init__(self, silent_for: float = 0.0) -> None:
        self.last_received = time.monotonic() - silent_for
        self.closed = False
        self.close_error: str | None = None
        self.peer = "the control plane at node1:4242"

    def close(self) -> None:
        self.closed = True


class FakeClient:
    rank = 2
    timeout = 300.0
    address = "node1:4242"
    supervisor_pid = 4321

    def __init__(self, silent_for: float = 0.0) -> None:
        self.link = FakeLink(silent_for)

    @property
    def closed(self) -> bool:
        return self.link.closed


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    def exit_(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr("lightning_prague.core.client.control.os._exit", exit_)


def stepping_session(silent_for: float = 0.0, long_bound: float = 300.0) -> Session:
    beacon = Beacon(HangRule(floor=10.0))
    beacon.bump()
    beacon.bump()  # one step timed: the bound is 10 s
    session = Session(FakeClient(silent_for), 1, 4, beacon, long_bound=long_bound)  # type: ignore[arg-type]
    session._opened -= silent_for
    return session


def test_a_lost_plane_is_an_error_of_the_training_thread_at_its_next_contact_not_an_exit(exits):
    session = stepping_session()
    session.raise_if_cut_off()  # reachable: nothing
    session.cut("rank 2: the control plane at node1:4242 closed the connection; it stopped or failed")
    session.check_reachable()  # within the grace: the process goes on
    with pytest.raises(ControlPlaneLost) as raised:
        session.raise_if_cut_off()
    assert isinstance(raised.value, ControlPlaneError) and isinstance(raised.value, CoordinationTimeout)
    text = str(raised.value)
    assert "rank 2: the control plane at node1:4242 closed the connection" in text and "(during training)" in text
    assert "supervisor process, pid 4321" in text
    with pytest.raises(ControlPlaneLost, match=r"during checking"):
        session.check_members("checking")  # every contact raises alike
    # the training thread raised: its exception path (a checkpoint) has the long bound, not the grace
    session._cut_since -= 100.0
    session.check_reachable()
    session._cut_since -= 300.0
    with pytest.raises(Exited):
        session.check_reachable()


def test_a_training_thread_that_never_gets_to_the_plane_is_ended_after_its_grace(exits, capsys):
    session = stepping_session()
    session.cut("rank 2: the control plane at node1:4242 closed the connection; it stopped or failed")
    # a raise on another thread (a communication thread) does not stand the last resort down
    seen = []
    thread = threading.Thread(target=lambda: seen.append(session.plane_lost("an exchange")))
    thread.start()
    thread.join()
    assert isinstance(seen[0], ControlPlaneLost)
    session._cut_since -= 9.0
    session.check_reachable()  # its bound (10 s) not yet passed
    session._cut_since -= 2.0
    with pytest.raises(Exited) as exited:
        session.check_reachable()
    assert exited.value.args == (partition.FENCED_EXIT_STATUS,)
    err = capsys.readouterr().err
    assert "rank 2: the control plane at node1:4242 closed the connection" in err
    assert "did not get to a contact with the control plane" in err and "exit status 75" in err


def test_silence_beyond_the_bound_cuts_the_session_off_and_closes_the_connection_before_any_exit(exits):
    session = stepping_session(silent_for=13.0)  # beyond 10 s plus the 2 s margin, within the grace
    session.check_reachable()
    assert session.client.link.closed, "waits on the plane fail at once, not at their timeouts"
    with pytest.raises(ControlPlaneLost, match=r"rank 2 on .*: cut off from the control plane at node1:4242"):
        session.raise_if_cut_off()
    session._cut_since -= 10.0
    session.check_reachable()  # the training thread raised: not the grace but the long bound applies


def test_a_fit_that_failed_otherwise_gets_the_long_bound_for_its_exception_path(exits):
    # the strategy's on_exception says so (a ControlPlaneLost of a communication thread, re-raised as it is)
    session = stepping_session()
    session.fit_failed()
    session.cut("rank 2: the control plane at node1:4242 closed the connection; it stopped or failed")
    session._cut_since -= 100.0
    session.check_reachable()  # beyond its grace (10 s), within the long bound (300 s)


@pytest.mark.parametrize("contact", ["send", "request"])
def test_a_send_that_fails_before_the_reader_sees_the_close_is_the_same_lost_plane(exits, contact):
    """The sender may see the broken connection before the reader thread does (a broken pipe while the
    end of file is still unread): its error is the plane lost, with the same words, not a timeout."""
    from lightning_prague.core.client.link import MessageLink

    link = object.__new__(MessageLink)  # a link whose socket the plane has closed; its reader has not seen it yet
    link.rank, link.timeout, link.peer, link.sent = 2, 300.0, "the control plane at node1:4242", 0
    link._send_lock = threading.Lock()
    link._seq, link._unacked, link.reconnecting, link.reconnect_within, link._closing = 0, [], False, 0.0, False
    link.closed = False
    link._sock = types.SimpleNamespace(sendall=lambda data: (_ for _ in ()).throw(BrokenPipeError(32, "Broken pipe")))
    session = stepping_session()
    session.client.send = link.send  # type: ignore[attr-defined]
    session.client.begin = lambda message, *args, **kwargs: link.send(message)  # type: ignore[attr-defined]
    with pytest.raises(ControlPlaneLost) as raised:
        session.send("beat") if contact == "send" else session.request("kv", "a counter")
    text = str(raised.value)
    assert "rank 2: the control plane at node1:4242 closed the connection" in text, text
    assert "the job cannot go on without its control plane" in text and session.cut_off is not None


def test_restarts_after_a_lost_plane_fail_the_fit_instead_of_reporting_it_ended(tmp_path, monkeypatch):
    """`max_restarts` with forked ranks: the supervisor is SIGKILLed mid-fit, every rank's fit fails with
    `ControlPlaneLost` (exit status 1), and each is restarted. A restart that finds nothing at the
    job's store once ended its fit quietly, as if the others had finished it, and `fit` returned as if
    it had trained (a fit of 0 steps). Its predecessor's failure says otherwise: it fails too, and
    `fit` in the process that called it fails, naming the lost rank 0."""
    from lightning_prague.core import job

    monkeypatch.setattr(job, "STORE_GONE_SECONDS", 0.5)  # the forked ranks inherit it
    monkeypatch.setenv(PLANE_WAIT_VARIABLE, "0")
    argv = ["--strategy", "prague", "--epochs", "30", "--step-time", "0.02", "--group-size", "2", "--devices", "2"]
    argv += ["--start-method", "fork", "--max-restarts", "1", "--kill-plane-batch", "3"]
    argv += ["--exception-checkpoint", str(tmp_path / "on_exception"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc, _ = run_training(tmp_path, *argv, script="plane_loss.py", timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]  # the fit raised in the process that called it
    report = json.loads((tmp_path / "result.rank0.json").read_text())
    assert (
        report["type"] == "ConfigurationError" and "local rank 0's last process exited with status 1" in report["error"]
    )
    assert proc.stderr.count("this rank's previous process failed its fit (exit status 1)") == 2, proc.stderr[-3000:]
    assert "has nothing to train: its fit ends here" not in proc.stderr
