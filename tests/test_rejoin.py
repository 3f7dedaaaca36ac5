"""A lost worker comes back: respawn by the strategy's launcher, admission at an epoch's end, the state
from a live member (`lightning_prague.strategies.rejoin`, `Job.rejoin`, `GroupGenerator`'s `Rejoining`).

One real job (the slow part): four CPU workers under the strategy's launcher with `max_restarts=1`,
rank 0 kills itself with SIGKILL at its 20th batch; the agent starts it again, it rejoins, gets the
fit's state from rank 1 and trains to the end with the others. The rest are message-level and unit tests.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from helpers import SCRIPTS, run_core_ranks, run_forked_together

from lightning_prague.core import job as job_module
from lightning_prague.core.auth import LAUNCH_VARIABLE
from lightning_prague.core.comm.collectives import encode_object
from lightning_prague.core.comm.transfer import receive_payload, send_payload
from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout
from lightning_prague.core.grouping.policies import make_policy
from lightning_prague.core.job import REJOIN_VARIABLE, RESTARTS_VARIABLE, rejoining
from lightning_prague.core.plane.coordinator import ControlPlane
from lightning_prague.core.plane.generator import GroupGenerator
from lightning_prague.core.protocol import SessionConfig, donor_of
from lightning_prague.strategies import PartialAllReduceStrategy
from lightning_prague.strategies.launcher import RankAgent
from lightning_prague.strategies.rejoin import MAX_METRICS, PeerState, members_metrics, readable, scalar_metrics
from lightning_prague.strategies.spare import read_environment, spare_environment


@pytest.mark.timeout(300)
def test_a_killed_rank_0_rejoins_and_two_new_workers_join_the_running_fit(tmp_path):
    """One job for both: rank 0 is killed and forked again by the agent; ranks 4 and 5 (`max_workers=6`)
    are started by hand once the four are training, as a user adds workers to a running job."""
    out = tmp_path / "result.json"
    command = ["--strategy", "prague", "--devices", "4"]
    command += ["--epochs", "15", "--step-time", "0.1", "--profile", "homogeneous", "--fault", "0:20:kill"]
    command += ["--max-workers", "6", "--hang-timeout", "10", "--json", str(out)]
    command += ["--csv-dir", str(tmp_path / "csv")]
    joiner_command = [*command, "--max-restarts", "0"]  # each a process of its own, as a user starts one
    command += ["--max-restarts", "1", "--start-method", "fork"]  # the agent forks the ranks and the restart
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **{LAUNCH_VARIABLE: "scale-up-test"})
    # the job and the two joiners, forked from this process (no interpreter starts); the joiners start
    # once the four are training
    started = [str(tmp_path / f"pid.{r}") for r in range(4)]
    runs = [("lightning_prague.demo.run", command, env, tmp_path)]
    for local in (0, 1):
        joiner_env = {**env, "NODE_RANK": "1", "LOCAL_RANK": str(local), REJOIN_VARIABLE: "1"}
        runs.append(
            (SCRIPTS / "gated.py", [*started, "--", "lightning_prague.demo.run", *joiner_command], joiner_env, tmp_path)
        )
    job, *joiners = run_forked_together(runs, timeout=240)
    for i, proc in enumerate([job, *joiners]):
        (tmp_path / f"log{i}.txt").write_text(proc.stderr)
    stderr, *errors = [(tmp_path / f"log{i}.txt").read_text() for i in range(3)]
    assert job.returncode == 0, stderr[-4000:]  # the agent: every rank's last process exited 0
    assert [p.returncode for p in joiners] == [0, 0], [e[-3000:] for e in errors]
    # the leader writes result.json: rank 1, which took over when rank 0 was lost and keeps leading
    results = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("result*.json"))}
    assert sorted(results) == list(range(6)), (sorted(results), stderr[-4000:])
    assert json.loads(out.read_text())["rank"] == 1
    assert results[0]["restarts"] == 1 and all(results[r]["restarts"] == 0 for r in (1, 2, 3))
    for rank in (0, 4, 5):  # the new rank 0 and the two new workers trained after they joined
        assert results[rank]["batches_this_process"] > 0, rank
    assert "rejoined the job inside the epoch" in stderr  # at once, with no meeting of the members
    for result in results.values():  # every fit ran to its end, on one consensus model
        assert result["epochs_run"] == 15
        assert result["params_sha256"] == results[1]["params_sha256"]
    # the leader logged the live workers at its synchronization points: 6 once everyone is in (3, 4 or 5
    # on the way, as rank 0 and the two new workers are admitted between them or not: each is admitted at
    # the members' next batch boundary); the original rank 0's rows are the successor's logger's to
    # rewrite (a fixed-version CSVLogger)
    live = set()
    for metrics in (tmp_path / "csv").rglob("metrics.csv"):
        rows = list(csv.DictReader(metrics.open()))
        live |= {float(row["workers/live"]) for row in rows if row.get("workers/live")}
    assert {6.0} <= live <= {3.0, 4.0, 5.0, 6.0}, live
    # the supervisor's log stays next to the trainer's (its default_root_dir is the working directory)
    assert list((tmp_path / "lightning_prague_logs").glob("supervisor-*.log")), stderr[-2000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the generator: who is admitted, where ----------------------------------------------------------
def generator_without(rank: int, world: int = 4) -> GroupGenerator:
    generator = GroupGenerator(world, make_policy("random", world, 2, seed=1))
    generator.depart(rank, {})
    return generator


def meet(generator: GroupGenerator, ranks, sync: str) -> dict:
    out: dict = {}
    for rank in ranks:
        for r, items in generator.handle({"op": "arrive", "rank": rank, "sync": sync}).items():
            out.setdefault(r, []).extend(items)
    return out


def test_a_joiner_is_admitted_at_once_in_a_membership_epoch_of_its_own_with_no_meeting():
    generator = generator_without(2)
    out: dict = {}
    generator.request_join(2, out)
    news = {"epoch": 1, "members": [0, 1, 2, 3], "joined": [2], "donor": 0, "donors": [[2, 0]], "leader": 0}
    for rank in (0, 1, 3):  # nobody meets: each follows the epoch where the item stands in its inbox
        assert out[rank] == [{"t": "members", **news}]
    assert out[2] == [{"t": "admit", **news, "base": [0, 1, 3]}]
    assert generator.take_joined() == [2] and generator.live == [0, 1, 2, 3] and generator.epoch == 1
    # a group issued from here comes after the epoch in every inbox, and draws the joiner once it trains
    generator.handle({"op": "ready", "rank": 2, "req": 1})
    later = generator.handle({"op": "ready", "rank": 0, "req": 1})
    assert later[0][-1]["t"] == "answer"


def test_a_replicas_joiners_are_admitted_together_once_all_of_them_asked():
    """In replica groups (`replica_size`) a replica trains whole: its new processes are admitted in one
    membership epoch, and not before the last of them asks; inside an epoch and in an epoch's end's
    release alike."""
    for after_epoch in (False, True):
        generator = GroupGenerator(6, make_policy("random", 6, 2, seed=1), replica_size=2)
        generator.depart(3, {})
        generator.depart(2, {})
        out: dict = {}
        generator.request_join(3, out, after_epoch=after_epoch)
        assert out == {} and generator.live == [0, 1, 4, 5], "half a replica waits for the other half"
        if after_epoch:  # an epoch's end comes and goes: it still waits
            assert 3 not in meet(generator, [0, 1, 4, 5], "epoch_end@epoch0")
            for rank in (0, 1, 4, 5):
                generator.handle({"op": "resume", "rank": rank})
        generator.request_join(2, out, after_epoch=after_epoch)
        if after_epoch:
            out = meet(generator, [0, 1, 4, 5], "epoch_end@epoch1")
        admitted = [item for rank in (2, 3) for item in out[rank] if item["t"] == "admit"]
        assert [item["joined"] for item in admitted] == [[2, 3], [2, 3]], out
        assert {item["epoch"] for item in admitted} == {1} and generator.live == [0, 1, 2, 3, 4, 5]


def test_a_sharded_replica_gets_each_ranks_shard_from_the_same_rank_of_the_lowest_replica_that_trains():
    """With replicas sharded over their ranks (`shard`), joiner `j` gets its state from rank `j % K` of
    one live replica, the lowest whose ranks all train: not from a replica that is itself starting."""
    generator = GroupGenerator(6, make_policy("random", 6, 2, seed=1), replica_size=2, shard=True)
    for rank in (0, 1):
        generator.depart(rank, {})
    out: dict = {}
    for rank in (1, 0):
        generator.request_join(rank, out)
    admit = [item for item in out[0] if item["t"] == "admit"][0]
    assert admit["donors"] == [[0, 2], [1, 3]] and admit["donor"] == 2, admit
    assert all(item["donors"] == [[0, 2], [1, 3]] for r in (2, 3, 4, 5) for item in out[r]), out
    # replica 0 is starting (rank 1 has not trained yet): replica 2's joiners get theirs from replica 1
    generator.started(0)
    for rank in (4, 5):
        generator.depart(rank, {})
    out = {}
    for rank in (4, 5):
        generator.request_join(rank, out)
    admit = [item for item in out[4] if item["t"] == "admit"][0]
    assert admit["donors"] == [[4, 2], [5, 3]], admit
    # without shard, one donor for every joiner
    generator = GroupGenerator(6, make_policy("random", 6, 2, seed=1), replica_size=2)
    for rank in (2, 3):
        generator.depart(rank, {})
    out = {}
    for rank in (2, 3):
        generator.request_join(rank, out)
    assert [item for item in out[2] if item["t"] == "admit"][0]["donors"] == [[2, 0], [3, 0]]


@pytest.mark.parametrize(
    "item,expected",
    [
        ({"donor": 0, "donors": [[2, 0], [3, 1]]}, 1),
        ({"donor": 0}, 0),
        ({"donor": 0, "donors": [[2, 0]]}, 0),  # (not named: the admission's donor)
        ({"donor": 0, "donors": [[3, "1"]]}, 0),
        ({"donor": 0, "donors": [[3, -5]]}, -1),
        ({"donor": 0, "donors": [[3, 1 << 40]]}, -1),
        ({"donor": 0, "donors": "3:1"}, 0),
        ({"donor": 0, "donors": [[3]]}, 0),
        ({"donor": "0"}, -1),
        ({"donor": True}, -1),
        ({}, -1),
    ],
)
def test_a_joiners_donor_is_read_from_its_admission_and_anything_malformed_names_none(item, expected):
    assert donor_of(item, 3) == expected


def test_a_joiner_is_held_while_the_members_meet_and_until_they_all_trained_again():
    generator = generator_without(2)
    meet(generator, [0], "epoch_end@epoch0")
    out: dict = {}
    generator.request_join(2, out)
    assert out == {}  # rank 0 waits at a meeting
    released = meet(generator, [1, 3], "epoch_end@epoch0")
    assert released[0][-1]["members"] == [0, 1, 3] and 2 not in released
    # sub-meetings may follow the release (a global average's commit): nobody is admitted before every
    # member trains again
    assert 2 not in meet(generator, [0, 1, 3], "epoch_end@epoch0/commit")
    assert generator.handle({"op": "resume", "rank": 0}) == {} and generator.handle({"op": "resume", "rank": 1}) == {}
    admitted = generator.handle({"op": "resume", "rank": 3})
    assert admitted[2][0]["t"] == "admit" and "at" not in admitted[2][0]
    assert [i["t"] for i in admitted[0]] == ["members"] and generator.live == [0, 1, 2, 3]


def test_a_joiner_with_nothing_left_in_the_epoch_is_admitted_in_its_ends_release_and_skips_its_sub_meetings():
    generator = generator_without(2)
    generator.request_join(2, {}, after_epoch=True)
    validation = meet(generator, [0, 1, 3], "validation@epoch1")
    assert validation[0][-1]["joining"] == [2] and 2 not in validation  # not admitted at validation
    assert meet(generator, [0, 1, 3], "validation@epoch1/commit")[0][-1]["sync"] == "validation@epoch1/commit"
    for rank in (0, 1, 3):
        assert generator.handle({"op": "resume", "rank": rank, "s": 1}) == {}  # still for the epoch's end
    released = meet(generator, [0, 1, 3], "epoch_end@epoch1")
    members = [i for i in released[0] if i["t"] == "members"]
    release = [i for i in released[0] if i["t"] == "release"][-1]
    assert released[0].index(members[0]) < released[0].index(release)  # the epoch before the release
    assert members[0]["at"] == "epoch_end@epoch1" and members[0]["joined"] == [2]
    assert release["joined"] == [2] and release["members"] == [0, 1, 2, 3] and release["epoch"] == 1
    assert [i["t"] for i in released[2]] == ["admit"] and released[2][0]["at"] == "epoch_end@epoch1"
    commit = meet(generator, [0, 1, 3], "epoch_end@epoch1/commit")  # the members' own global average
    assert commit[0][-1]["sync"] == "epoch_end@epoch1/commit" and 2 not in commit
    # the joiner meets the others at the next meeting like any member
    assert meet(generator, [0, 1, 3], "epoch_end@epoch2") == {}
    assert meet(generator, [2], "epoch_end@epoch2")[2][-1]["sync"] == "epoch_end@epoch2"


def test_a_joiner_is_told_when_the_fit_ends_without_it():
    generator = generator_without(2)
    generator.request_join(2, {}, after_epoch=True)
    out = meet(generator, [0, 1, 3], "fit_end")
    assert out[2][0]["t"] == "error" and "fit ended" in out[2][0]["message"]
    assert out[2][0]["ended"] is True  # its fit ends quietly (`FitEnded`)
    with pytest.raises(ValueError, match="live member"):
        generator.request_join(1)


def ask_round(generator: GroupGenerator, rank: int, round_index: int, slots, start: bool = False) -> dict:
    message = {"op": "round", "rank": rank, "key": f"m{round_index}.{min(slots or [rank])}", "round": round_index}
    out: dict = {}
    generator.round_members(rank, message["key"], round_index, slots, start, out)
    return out[rank][0]


def test_every_member_of_a_gossip_round_gets_the_same_members_whenever_it_asks():
    """A lost rank drops out of the rounds after those decided with it; its new process comes in at a
    round after every round decided so far, on every member of its groups alike, with no meeting."""
    generator = GroupGenerator(4, make_policy("random", 4, 2, seed=1))
    assert ask_round(generator, 0, 5, [0, 2]) == {"t": "round", "key": "m5.0", "members": [0, 2], "epoch": 0}
    generator.depart(2, {})
    assert ask_round(generator, 1, 5, [1, 2])["members"] == [1, 2]  # decided with it before: the same answer
    assert ask_round(generator, 0, 6, [0, 2])["members"] == [0]  # after: without it
    out: dict = {}
    generator.request_join(2, out)
    assert ask_round(generator, 0, 7, [0, 2])["members"] == [0]  # admitted, not training yet: not drawn
    start = ask_round(generator, 2, 0, [], start=True)
    assert start["round"] == 8  # after every round decided so far
    for rank in (0, 2):  # round 7 was decided without it, on everyone; from round 8 on it takes part
        assert ask_round(generator, rank, 7, [0, 2])["members"] == [0]
        assert ask_round(generator, rank, 8, [0, 2]) == {
            "t": "round", "key": "m8.0", "members": [0, 2], "epoch": 1,
        }  # fmt: skip
    assert ask_round(generator, 3, 9, [2, 3])["epoch"] == 1  # its process group: the joiner's epoch's


# -- the control plane: who may rejoin ----------------------------------------------------------
def config(world: int = 4, seed: int = 1) -> dict:
    return SessionConfig(world, make_policy("random", world, 2, seed=seed).spec()).to_wire()


def join(plane: ControlPlane, rank: int, wire: dict, rejoin: bool = False) -> dict:
    message = {"op": "join", "s": 1, "rank": rank, "config": wire, "pid": 1000 + rank, "host": "h"}
    return plane.handle({**message, **({"rejoin": True} if rejoin else {})})


def test_the_control_plane_refuses_a_rejoin_it_cannot_take():
    plane = ControlPlane()
    assert "no such fit" in join(plane, 1, config(), rejoin=True)[1][0]["message"]
    for rank in range(4):
        join(plane, rank, config())
    assert "live member" in join(plane, 1, config(), rejoin=True)[1][0]["message"]
    plane.on_disconnect(1)
    assert "another configuration" in join(plane, 1, config(seed=2), rejoin=True)[1][0]["message"]
    admitted = join(plane, 1, config(), rejoin=True)  # accepted, and admitted at once
    assert sorted(admitted) == [0, 1, 2, 3] and admitted[0][0]["t"] == "members" and admitted[1][0]["t"] == "admit"
    assert 1 in plane.sessions[1].members and plane.sessions[1].generator.joining == []


def trained(plane: ControlPlane, rank: int, epoch: int, batches: int = 5, total: int = 13) -> None:
    """A lock-step rank's report of where it stands in its shard (`ShardLoaders.report_position`)."""
    message = {"op": "trained", "s": 1, "rank": rank, "epoch": epoch, "batches": batches, "shard": rank, "of": 4}
    plane.handle({**message, "total": total})


def plane_that_lost(losses: list[tuple[int, int]]) -> ControlPlane:
    """A control plane of 4 lock-step ranks that all trained in epoch 0; each `(rank, epoch)` of
    `losses` in turn: the live ranks report a batch of `epoch`, then `rank`'s process ends."""
    plane = ControlPlane()
    for rank in range(4):
        join(plane, rank, config())
    live = set(range(4))
    for rank in sorted(live):
        trained(plane, rank, epoch=0)
    for lost, epoch in losses:
        for rank in sorted(live):
            trained(plane, rank, epoch=epoch)
        plane.on_disconnect(lost)
        live.discard(lost)
    return plane


def test_a_lock_step_rank_lost_in_an_earlier_epoch_is_admitted_at_the_members_epoch_end_not_inside_it():
    """Inside the members' epoch its shard holds nothing for the new process (a zero-batch member
    crashed two survivors' gloo pairs: its idle rounds met a validation collective), so the control
    plane admits it at the members' epoch's end, in that meeting's release."""
    plane = plane_that_lost([(2, 0)])
    for rank in (0, 1, 3):
        trained(plane, rank, epoch=1)  # the members moved on
    assert join(plane, 2, config(), rejoin=True) == {}  # not admitted inside the epoch: it waits
    session = plane.sessions[1]
    assert session.generator.joining == [2] and session.generator.after_epoch == {2}
    generator = session.generator
    validation = meet(generator, [0, 1, 3], "validation@epoch1")
    assert validation[0][-1]["joining"] == [2] and 2 not in validation  # so they meet at the epoch's end
    for rank in (0, 1, 3):
        generator.handle({"op": "resume", "rank": rank})
    released = meet(generator, [0, 1, 3], "epoch_end@epoch1")
    assert released[2][0]["t"] == "admit" and released[2][0]["at"] == "epoch_end@epoch1"
    assert generator.after_epoch == set() and generator.live == [0, 1, 2, 3]


def test_a_rank_lost_in_the_members_epoch_is_admitted_at_once_and_one_for_an_epoch_end_waits_beside_it():
    plane = plane_that_lost([(1, 0), (2, 1)])  # rank 2 lost in epoch 1, the members' epoch
    assert join(plane, 1, config(), rejoin=True) == {}  # for the epoch's end
    admitted = join(plane, 2, config(), rejoin=True)  # it has the rest of its shard: admitted now
    assert admitted[2][0]["t"] == "admit" and admitted[2][0]["joined"] == [2] and 1 not in admitted
    assert admitted[2][0]["position"]["epoch"] == 1  # where its rank stood: its new process reads on from there
    generator = plane.sessions[1].generator
    assert generator.joining == [1] and generator.live == [0, 2, 3]


def test_a_lock_step_rank_that_trained_its_whole_shard_of_the_epoch_waits_for_its_end():
    """Lost after its epoch's last batch (in validation, say): the members' epoch holds nothing more
    for it either, though they are still in it."""
    plane = plane_that_lost([])
    trained(plane, 2, epoch=0, batches=13)  # all 13 of its shard
    plane.on_disconnect(2)
    assert join(plane, 2, config(), rejoin=True) == {}
    assert plane.sessions[1].generator.after_epoch == {2}


def test_work_queue_shards_report_no_position_and_every_joiner_is_admitted_at_once():
    plane = ControlPlane()
    for rank in range(4):
        join(plane, rank, config())
    plane.on_disconnect(3)
    assert join(plane, 3, config(), rejoin=True)[3][0]["t"] == "admit"
    assert plane.sessions[1].generator.after_epoch == set()


def test_a_joiner_takes_the_donors_scalar_metrics_and_nothing_else_it_sent():
    sent = scalar_metrics({"val_acc": torch.tensor(0.9), "step": 3, "hist": torch.ones(4), "flag": True})
    assert sent == {"val_acc": pytest.approx(0.9), "step": 3.0}  # one number each
    taken = members_metrics(sent)
    assert set(taken) == {"val_acc", "step"} and float(taken["val_acc"]) == pytest.approx(0.9)
    hostile = {"x" * 500: 1.0, 7: 2.0, "ok": 1.5, "list": [1.0], "text": "1.0", "nested": {"a": 1.0}, "b": True}
    assert list(members_metrics(hostile)) == ["ok"]
    assert members_metrics(["val_acc", 1.0]) == {} and members_metrics(None) == {}
    assert len(members_metrics({f"m{i}": 1.0 for i in range(10 * MAX_METRICS)})) == MAX_METRICS


# -- options, environment, payload ---------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_restarts_must_be_a_count(bad):
    with pytest.raises(ConfigurationError, match="max_restarts=.* is invalid"):
        PartialAllReduceStrategy(max_restarts=bad)
    assert PartialAllReduceStrategy(max_restarts=2).max_restarts == 2


def test_rejoining_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(RESTARTS_VARIABLE, raising=False)
    monkeypatch.delenv(REJOIN_VARIABLE, raising=False)
    assert not rejoining()
    monkeypatch.setenv(RESTARTS_VARIABLE, "2")
    assert rejoining()
    monkeypatch.setenv(RESTARTS_VARIABLE, "0")
    monkeypatch.setenv(REJOIN_VARIABLE, "1")
    assert rejoining()
    monkeypatch.setenv(REJOIN_VARIABLE, "yes")
    with pytest.raises(ConfigurationError, match=REJOIN_VARIABLE):
        rejoining()


def test_the_state_sent_to_a_joiner_leaves_out_what_a_safe_load_cannot_read():
    class Opaque:
        pass

    dropped: list[str] = []
    kept = readable({"w": torch.ones(2), "hp": {"lr": 0.1, "obj": Opaque()}, "xs": [1, Opaque()]}, "ckpt", dropped)
    assert set(kept) == {"w", "hp", "xs"} and kept["hp"] == {"lr": 0.1} and kept["xs"] == [1]
    assert dropped == ["ckpt['hp']['obj'] (Opaque)", "ckpt['xs'][1] (Opaque)"]


class FakeProcess:
    """A process whose exit statuses are scripted."""

    def __init__(self, codes: list[int | None]) -> None:
        self.codes, self.pid, self.returncode = list(codes), 1, None

    def poll(self):
        self.returncode = self.codes.pop(0) if self.codes else self.returncode
        return self.returncode


def test_the_agent_restarts_a_lost_rank_within_its_budget_then_leaves_it_lost(monkeypatch):
    import lightning_prague.strategies.launcher as launcher

    started: list[tuple[int, int]] = []

    def start(local_rank: int, restarts: int) -> FakeProcess:
        started.append((local_rank, restarts))
        return FakeProcess([None, -9])  # every process of local rank 0 is killed at once

    monkeypatch.setattr(launcher, "RESTART_BACKOFF", 0.0)
    monkeypatch.setattr(RankAgent, "_start", staticmethod(start))
    agent = RankAgent([FakeProcess([None, 0])], max_restarts=2, period=0.0)
    assert agent.run() == 1  # rank 0 stays lost after its two restarts: the job did not end well
    assert started == [(0, 0), (0, 1), (0, 2)] and agent.status == {0: -9, 1: 0}
    assert agent.previous == {0: -9}  # what each restart was told of its predecessor's end


# -- the warm spare ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [b"[1, 2]", b'{"A": 1}', b'{"A=B": "x"}', b"not json", b'{"A": "' + b"x" * (1 << 20) + b'"}'],
)
def test_a_spare_takes_only_an_environment_of_strings(line):
    with pytest.raises(ValueError):
        read_environment(line)


@pytest.mark.timeout(60)
def test_a_warm_spare_becomes_the_rank_its_agent_names(tmp_path):
    script = tmp_path / "rank.py"
    (tmp_path / "helper_next_to_it.py").write_text("VALUE = 'imported from the script folder'\n")
    script.write_text(
        "import json, os, sys\n"
        "from helper_next_to_it import VALUE\n"
        "if __name__ == '__main__':\n"
        "    out = {'argv': sys.argv[1:], 'rank': os.environ.get('LOCAL_RANK'), 'stale': os.environ.get('STALE')}\n"
        "    open(sys.argv[1], 'w').write(json.dumps({**out, 'value': VALUE}))\n"
    )
    out = tmp_path / "out.json"
    env = spare_environment([str(script)], {**os.environ, "STALE": "from the agent's start"})
    spare = subprocess.Popen(
        [sys.executable, "-m", "lightning_prague.strategies.spare", str(script), str(out), "--flag"],
        stdin=subprocess.PIPE,
        env=env,
    )
    rank_env = {k: v for k, v in os.environ.items() if k != "STALE"}
    spare.communicate(json.dumps({**rank_env, "LOCAL_RANK": "3"}).encode() + b"\n", timeout=50)
    assert spare.returncode == 0
    expected = {"argv": [str(out), "--flag"], "rank": "3", "stale": None, "value": "imported from the script folder"}
    assert json.loads(out.read_text()) == expected
    idle = subprocess.Popen(
        [sys.executable, "-m", "lightning_prague.strategies.spare", str(script)], stdin=subprocess.PIPE
    )
    idle.communicate(b"", timeout=50)  # the agent ended: the spare runs nothing
    assert idle.returncode == 0


# -- the state on the wire: what a joiner refuses --------------------------------------------------
class ScriptedComm:
    """`GroupComm.point_to_point` over a list of tensors (what the donor sends), failing where told."""

    rank = 2

    def __init__(self, sent: list[torch.Tensor] | None = None, fail_at: int | None = None) -> None:
        self.sent = list(sent or [])
        self.calls = 0
        self.fail_at = fail_at

    def point_to_point(self, tensor: torch.Tensor, peer: int, send: bool, operation: str) -> None:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise CoordinationTimeout(f"rank {self.rank}: {operation} with rank {peer} failed: peer gone")
        if send:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.sent.pop(0))


def test_a_joiner_refuses_an_announced_size_above_its_bound_before_allocating():
    comm = ScriptedComm([torch.tensor([1 << 40], dtype=torch.int64)])
    with pytest.raises(CoordinationTimeout, match="announced the fit's state of 1099511627776 bytes"):
        receive_payload(comm, 0, "the fit's state", limit=1 << 30)  # type: ignore[arg-type]


def test_a_transfer_that_breaks_mid_way_fails_on_both_sides(monkeypatch):
    import lightning_prague.core.comm.transfer as transfer

    monkeypatch.setattr(transfer, "PIECE_BYTES", 4)
    donor = ScriptedComm(fail_at=3)  # the size and one piece went out; the peer is gone at the second
    with pytest.raises(CoordinationTimeout, match="peer gone"):
        send_payload(donor, 3, b"0123456789", "the fit's state")  # type: ignore[arg-type]
    joiner = ScriptedComm([*donor.sent], fail_at=3)  # what arrived before the break
    with pytest.raises(CoordinationTimeout, match="peer gone"):
        receive_payload(joiner, 0, "the fit's state")  # type: ignore[arg-type]
    whole = ScriptedComm()
    send_payload(whole, 3, b"0123456789", "the fit's state")  # type: ignore[arg-type]
    assert receive_payload(ScriptedComm(whole.sent), 0, "the fit's state") == b"0123456789"  # type: ignore[arg-type]


class _Runs:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning-prague-rejoin-pwned",))


@pytest.mark.parametrize(
    "payload",
    [b"not a checkpoint at all", pickle.dumps(_Runs()), pickle.dumps([1, 2])],
    ids=["garbage", "a pickle that runs code", "not a checkpoint"],
)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_joiner_refuses_a_state_that_is_not_a_checkpoint_and_runs_nothing(payload, tmp_path):
    if os.path.exists("/tmp/lightning-prague-rejoin-pwned"):
        os.unlink("/tmp/lightning-prague-rejoin-pwned")
    peer = PeerState(SimpleNamespace(lightning_module=torch.nn.Linear(2, 2), global_rank=2))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="is not a checkpoint"):
        peer.checkpoint(payload)
    assert not os.path.exists("/tmp/lightning-prague-rejoin-pwned")


def test_a_joiner_with_another_model_is_told_which_parameters_differ():
    theirs = encode_object({"state_dict": {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}})
    assert theirs is not None
    peer = PeerState(SimpleNamespace(lightning_module=torch.nn.Linear(2, 2), global_rank=2))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"cannot rejoin: its model is not the job's \(weight: \(2, 2\)"):
        peer.checkpoint(theirs)


def test_a_joiner_with_no_job_at_its_address_is_told_so_soon(monkeypatch):
    from lightning_prague.core.errors import FitEnded
    from lightning_prague.core.job import init_job

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing listens there
    monkeypatch.setattr(job_module, "STORE_GONE_SECONDS", 0.5)  # refused this long: gone (5 s in a job)
    start = time.monotonic()
    with pytest.raises(FitEnded, match=r"rank 2 found no running fit to rejoin: nothing listens at the job's store at"):
        init_job(2, 4, "gloo", timeout=2.0, pg_timeout=timedelta(seconds=1800), rejoin=True)
    assert time.monotonic() - start < 30  # bounded by the operation timeout, not the process group's
    torch.distributed.destroy_process_group()  # the local stand-in world it set up first


def test_a_joiner_whose_jobs_control_plane_is_gone_finds_the_fit_ended(monkeypatch):
    """torchrun: the job's store is the agent's, which outlives the fit (and the address the supervisor
    published in it), while the control plane ends with the fit: a process its keeper started again
    after the others finished finds the fit ended, instead of failing at the refused connection."""
    import json

    from lightning_prague.core.errors import FitEnded
    from lightning_prague.core.job import init_job
    from lightning_prague.core.protocol import address_key

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    gone = free_port()  # where the control plane listened
    store.set(address_key(), json.dumps({"host": "127.0.0.1", "port": gone, "pid": 4321, "launch": "tests"}))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LIGHTNING_PRAGUE_SECRET", "ab" * 32)
    monkeypatch.setenv("LIGHTNING_PRAGUE_LAUNCH_ID", "tests")
    monkeypatch.setattr(job_module, "STORE_GONE_SECONDS", 0.5)  # refused this long: gone (5 s in a job)
    start = time.monotonic()
    with pytest.raises(FitEnded, match=rf"nothing listens at the job's control plane at 127.0.0.1:{gone} \(refused"):
        init_job(1, 2, "gloo", timeout=30.0, pg_timeout=timedelta(seconds=1800), rejoin=True)
    assert time.monotonic() - start < 20  # the store answered at once; the control plane refused for 0.5 s
    torch.distributed.destroy_process_group()  # the local stand-in world it set up first


def test_a_torch_without_the_local_stand_in_cannot_rejoin(monkeypatch):
    from lightning_prague.core.job import _init_local_world

    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    with pytest.raises(ConfigurationError, match="rejoining a running job needs torch's `fake` process group"):
        _init_local_world(2, 4)


def test_what_the_payload_filter_keeps_a_weights_only_load_reads_back():
    import io
    import pathlib

    from lightning_prague.core.comm.collectives import decode_object

    dropped: list[str] = []
    state = {"w": torch.ones(2), "n": 3, "x": 0.5, "s": "a", "p": pathlib.PurePosixPath("/ckpt"), "t": (1, [2.0])}
    kept = readable({**state, "np": __import__("numpy").float64(1.5)}, "checkpoint", dropped)
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    back = decode_object(buffer.getvalue())
    assert back["np"] == 1.5 and type(back["np"]) is float and back["p"] == pathlib.PurePosixPath("/ckpt")
    assert back["t"] == (1, [2.0]) and torch.equal(back["w"], torch.ones(2)) and dropped == []


@pytest.mark.timeout(90)
def test_a_background_transfer_runs_beside_other_exchanges_and_before_any_with_its_receiver(tmp_path):
    donor, other, receiver = run_core_ranks(tmp_path, 3, script="transfer_worker.py")
    assert donor["sent_before_the_first_sum"] is False  # the sum with rank 1 ran while the state was out
    assert donor["sent_before_the_second_sum"] is True  # the sum with the receiver waited for it
    assert receiver["payload_intact"] is True
    assert donor["sum_with_2"] == receiver["sum_with_0"] == 101.0 and other["sum_with_0"] == 11.0


class _ScriptedSession:
    """A joiner's session that admits it at once (membership epoch `epoch`, donor `donor`)."""

    def __init__(self, epoch: int, donor: int) -> None:
        self.admission = {"epoch": epoch, "members": [0, 1, 2, 3], "donor": donor}
        self.departed: dict[int, str] = {}
        self.closed: list[bool] = []

    def await_admission(self, wait: float) -> dict:
        return self.admission

    def departed_for(self, epoch: int) -> set[int]:
        return set(self.departed)

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


def test_a_joiner_whose_state_never_arrives_from_a_live_donor_asks_again(monkeypatch):
    """The donor lives, but its send never reached the joiner (on gloo, a new group's pair that never
    connected): the receive's timeout costs an attempt, not the fit. The joiner leaves that admission
    (its session closes as failed: a departure) and asks again, in a new membership epoch."""
    import lightning_prague.core.membership as membership

    sessions = [_ScriptedSession(3, 0), _ScriptedSession(4, 1)]
    opened: list[int] = []

    def open_session(number: int, config: object, rejoin: bool = False) -> _ScriptedSession:
        opened.append(number)
        return sessions[len(opened) - 1]

    def receive(comm, donor, what, sender_gone=None):
        if donor == 0:
            raise CoordinationTimeout("rank 2: the size of the fit's state over ranks [2, 0] timed out after 60.0s")
        return b"state"

    monkeypatch.setattr(membership, "receive_payload", receive)
    monkeypatch.setattr(membership, "GroupComm", lambda *args: SimpleNamespace(rebind=lambda *a: None))
    monkeypatch.setattr(membership, "established_connections", lambda: {})
    monkeypatch.setattr(membership, "_heard_left", lambda session, rank: False)  # (the donor lives)
    job = SimpleNamespace(
        rank=2, world_size=4, sessions=1, group=None, members=(), control=SimpleNamespace(open_session=open_session)
    )
    job.adopt_epoch = lambda epoch, members, departed: None
    job.follow_leader = lambda admit: None
    job._rejoin_once = lambda *args: membership.Membership._rejoin_once(job, *args)
    admission = membership.Membership.rejoin(job, None, wait=5.0, timeout=60.0)  # type: ignore[arg-type]
    assert admission.donor == 1 and admission.payload == b"state" and admission.release["epoch"] == 4
    assert opened == [2, 2]  # the same fit's session, asked for twice
    assert sessions[0].closed == [True] and sessions[1].closed == []
