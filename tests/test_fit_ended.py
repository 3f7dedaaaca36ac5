"""A new process for a lost rank that comes after the others finished the fit ends quietly.

The others can finish while a lost rank's new process starts (a rank killed near an epoch's end,
a restarter's back-off, a slow start). Nothing then serves the job's store (the supervisor exits
with the last rank), or the control plane has no fit to admit it to. The process must not wait out
its store's or its admission's timeout (300 s, 30 min): it learns within seconds that the fit
ended (`FitEnded`), and a process a restarter started ends its fit without an error, so the job
exits 0. One started by hand to rejoin fails instead: its address may be wrong.
"""

from __future__ import annotations

import os
import socket
import time
import types

import pytest
from helpers import CREDENTIALS, free_port, run_forked

from lightning_prague.core import ControlPlane, SessionConfig, make_policy
from lightning_prague.core import job as job_module
from lightning_prague.core.client.control import Session
from lightning_prague.core.errors import ControlPlaneError, FitEnded
from lightning_prague.core.job import RESTARTS_VARIABLE
from lightning_prague.strategies.in_place import RejoinInPlace

pytestmark = pytest.mark.timeout(60)

WORLD = 4


def config_wire() -> dict:
    return SessionConfig(WORLD, make_policy("random", WORLD, 2, seed=1).spec()).to_wire()


def test_a_store_that_refuses_connections_is_taken_for_an_ended_fit_within_seconds(monkeypatch):
    monkeypatch.setattr(job_module, "STORE_GONE_SECONDS", 0.5)
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(FitEnded, match=rf"rank 2 found no running fit to rejoin: nothing listens .*127.0.0.1:{port}"):
        job_module._wait_for_listener(2, "127.0.0.1", port, timeout=300.0)
    assert time.monotonic() - start < 5.0
    with socket.socket() as listening:  # a live store: found at once
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        job_module._wait_for_listener(2, "127.0.0.1", listening.getsockname()[1], timeout=300.0)


def test_the_control_plane_tells_a_joiner_of_an_ended_fit_that_it_ended():
    plane = ControlPlane()
    # fit 1 never ran here (or ended, and its session is gone)
    join = {"op": "join", "s": 1, "rank": 2, "config": config_wire(), "pid": 7, "host": "h", "rejoin": True}
    out = plane.handle(join)
    assert [(i["t"], i.get("ended")) for i in out[2]] == [("error", True)], out
    # a joiner waiting for its admission when the last members close the fit
    for rank in range(WORLD):
        plane.handle({"op": "join", "s": 1, "rank": rank, "config": config_wire(), "pid": 10 + rank, "host": "h"})
    plane.handle({"op": "close", "s": 1, "rank": 2, "failed": True})
    plane.handle({"op": "arrive", "s": 1, "rank": 0, "sync": "epoch_end@epoch0"})  # (an admission waits for it)
    plane.handle({"op": "join", "s": 1, "rank": 2, "config": config_wire(), "pid": 20, "host": "h", "rejoin": True})
    assert plane.sessions[1].generator.joining == [2]
    ended = [plane.handle({"op": "close", "s": 1, "rank": rank}) for rank in (0, 1, 3)][-1]
    assert [(i["t"], i.get("ended")) for i in ended[2]] == [("error", True)], ended
    assert "the fit ended" in ended[2][0]["message"]


def test_a_joiner_raises_fit_ended_for_an_ended_fit_and_a_control_plane_error_for_any_other_refusal():
    client = types.SimpleNamespace(rank=2, timeout=5.0, closed=False, credentials=CREDENTIALS)
    session = Session(client, 1, WORLD)  # type: ignore[arg-type]
    session.deliver({"t": "error", "message": "rank 2 cannot rejoin fit 1: the fit ended", "ended": True, "s": 1})
    with pytest.raises(FitEnded, match="the fit ended"):
        session.await_admission(5.0)
    # the control plane's own refusal of the join (no such fit runs), come before the joiner waits
    refusal = ControlPlane().handle(
        {"op": "join", "s": 1, "rank": 2, "config": config_wire(), "pid": 7, "host": "h", "rejoin": True}
    )[2][0]
    session.deliver(refusal)
    with pytest.raises(FitEnded, match="no such fit runs"):
        session.await_admission(5.0)
    session.deliver({"t": "error", "message": "rank 2 cannot rejoin fit 1: the fit is stopping", "s": 1})
    with pytest.raises(ControlPlaneError) as refused:
        session.await_admission(5.0)
    assert not isinstance(refused.value, FitEnded)


def test_only_a_process_started_again_for_its_rank_ends_its_fit_quietly_when_the_fit_ended(monkeypatch):
    ended: list[BaseException] = []
    strategy = types.SimpleNamespace(session=None, on_exception=ended.append)
    trainer = types.SimpleNamespace(strategy=strategy, global_rank=2, training=False, should_stop=True)
    trainer._teardown = lambda: None

    def fit(model: object) -> str:
        raise FitEnded("rank 2 found no running fit to rejoin")

    monkeypatch.setenv(RESTARTS_VARIABLE, "1")  # a restarter's new process: nothing to train, no error
    assert RejoinInPlace(fit, trainer)("model") is None
    assert len(ended) == 1 and isinstance(ended[0], FitEnded)
    monkeypatch.delenv(RESTARTS_VARIABLE)  # started by hand to rejoin: the error stands
    with pytest.raises(FitEnded):
        RejoinInPlace(fit, trainer)("model")


def test_a_restarted_rank_that_finds_no_job_exits_0_within_seconds_instead_of_waiting_out_its_timeouts(tmp_path):
    """A real process (forked from this one, its imports done): rank 2 of a 4-rank demo job, started again
    by a restarter, after the job ended."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_PRAGUE_REJOIN",)}
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="2", LOCAL_RANK="2", NODE_RANK="0",
        WORLD_SIZE="4", **{RESTARTS_VARIABLE: "1"},
    )  # fmt: skip
    start = time.monotonic()
    done = run_forked("lightning_prague.demo.run", ["--strategy", "prague", "--devices", "4"], env, tmp_path, 50)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "found no running fit to rejoin" in done.stderr and "its fit ends here" in done.stderr
    assert time.monotonic() - start < 45  # not the store's timeout (300 s)
