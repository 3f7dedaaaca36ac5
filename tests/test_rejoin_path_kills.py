"""The rejoin path's own faults, each a `kill -9` at its chosen instant in real processes: none costs the job.

One real job (the slow part): four CPU workers forked by the strategy's launcher with `max_restarts=2`,
`decent_adam` (lock-step shards, whose gossip rounds take a joiner in once it trains),
one epoch of 180 batches per rank (1438 samples of the digits twice over, in batches of 4), 100 ms
steps. Faults strike chosen processes of a rank (`RANK@PROCESS`, `lightning_prague.demo.faults`):

- rank 2 is killed at its 20th batch; its first new process is admitted, gets the fit's state, and
  is killed before its first batch (`kill-before-training`); the next one rejoins and trains;
- rank 1 is killed at its 40th batch; its first new process runs another model (`other-model`:
  hidden layers twice as wide), is refused by name after its admission, and leaves; the next one
  rejoins and trains;
- rank 0 is killed inside the first state transfer it sends as a donor, once the payload's size
  went out (`kill-in-transfer`). Its joiner hears of the donor's departure, gives that admission up
  (its epoch's group connected to nobody but the donor: no member's round waits on it) and asks to
  rejoin again, in a new membership epoch, and another member sends the state; rank 0's own new
  process rejoins.

Every fit returns, on one consensus model, and every rank's shard is trained once: each new process
goes on from where its rank's last trained batch left it. The message-level cases of the same paths
run against the real `ControlPlane` in `tests/test_rejoin_faults.py`.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading

import pytest
import torch
from helpers import env, run_forked_together

from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout, MemberLost
from lightning_prague.core.job import REJOIN_VARIABLE, RESTARTS_VARIABLE
from lightning_prague.demo.faults import Fault, process_number

#: the digits' training samples, the times the epoch repeats them, and the batch size
SAMPLES, REPEATS, BATCH = 1438, 2, 4
#: the batches of each rank's shard of the epoch (lock-step shards: a quarter of it each)
SHARD = math.ceil(math.ceil(SAMPLES * REPEATS / 4) / BATCH)
FAULTS = ["2:20:kill", "2@1:1:kill-before-training", "1:40:kill", "1@1:1:other-model", "0:1:kill-in-transfer"]


@pytest.fixture(scope="module")
def kill_job(tmp_path_factory) -> tuple[int, dict[int, dict], str, list[str]]:
    """The job, its agent forked from this process (and its ranks from the agent): the agent's exit
    status, each rank's last process's result, the job's output, and the faults that struck (their files)."""
    out = tmp_path_factory.mktemp("rejoin_path_kills")
    argv = ["--strategy", "decent_adam", "--devices", "4", "--epochs", "1", "--batch-size", str(BATCH)]
    argv += ["--epoch-repeats", str(REPEATS), "--step-time", "0.1", "--profile", "homogeneous"]
    argv += ["--max-restarts", "2", "--hang-timeout", "10", "--json", str(out / "result.json")]
    argv += ["--start-method", "fork"]  # the agent forks each rank and each restart: no import per process
    argv += [arg for fault in FAULTS for arg in ("--fault", fault)]
    environ = {k: v for k, v in env().items() if k not in ("NODE_RANK", "WORLD_SIZE")}
    (job,) = run_forked_together([("lightning_prague.demo.run", argv, environ, out)], timeout=270)
    ranks = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("result*.json"))}
    struck = sorted(p.name for p in out.glob("fault.*.json"))
    return job.returncode, ranks, job.stdout + job.stderr, struck


def _counts(results: dict[int, dict]) -> dict[int, tuple[int, int]]:
    """Rank -> (its last process's restarts, the batches it trained)."""
    return {r: (results[r]["restarts"], results[r]["batches_this_process"]) for r in sorted(results)}


@pytest.mark.timeout(300)
def test_every_fit_returns_and_every_shard_is_trained_once_through_the_rejoin_paths_faults(kill_job):
    """Each fault struck; the job ended well; each rank's last process trained its shard on from where
    its rank's last trained batch left it (exact counts: nothing skipped, nothing twice)."""
    status, results, output, struck = kill_job
    assert status == 0, output[-4000:]  # the agent: every rank's last process exited 0
    assert sorted(results) == [0, 1, 2, 3], output[-4000:]
    assert struck == ["fault.0.json", "fault.1.json", "fault.1@1.json", "fault.2.json", "fault.2@1.json"]
    assert _counts(results) == {
        0: (1, results[0]["batches_this_process"]),  # rank 0's first process trained the rest of its shard
        1: (2, SHARD - 39),  # on from the 39 batches its first process trained; the refused one trained none
        2: (2, SHARD - 19),  # on from the 19 batches its first process trained; the one killed trained none
        3: (0, SHARD),
    }, output[-4000:]
    assert 0 < results[0]["batches_this_process"] < SHARD
    assert all(results[r]["epochs_run"] == 1 for r in results)
    assert len({results[r]["params_sha256"] for r in results}) == 1  # one consensus model


@pytest.mark.timeout(300)
def test_a_joiner_killed_between_its_admission_and_its_first_batch_leaves_no_trace(kill_job):
    """Rank 2's first new process was admitted and given the state, then killed before it trained: the
    members went on, and the next process was admitted in its place (see the counts above)."""
    status, _, output, _ = kill_job
    assert status == 0, output[-4000:]
    assert output.count("rank 2: rejoined the job inside the epoch") == 2, output[-4000:]
    assert re.search(
        r"local rank 2 \(pid \d+\) exited with status -9: starting it again in 2s \(restart 2 of 2\)", output
    )


@pytest.mark.timeout(300)
def test_a_joiner_with_another_model_is_refused_by_name_and_the_job_goes_on(kill_job):
    """Rank 1's first new process (hidden layers twice as wide) was refused once the state arrived, with
    the parameters that differ named; it failed alone, and the rank's next process rejoined."""
    status, _, output, _ = kill_job
    assert status == 0, output[-4000:]
    assert "rank 1 cannot rejoin: its model is not the job's (net.0.weight: (128, 64) torch.float32 here, " in output
    assert "(64, 64) torch.float32 in the job" in output
    # its process failed alone (the others trained on), and the agent started the rank again
    assert re.search(
        r"local rank 1 \(pid \d+\) exited with status 1: starting it again in 2s \(restart 2 of 2\)", output
    )


@pytest.mark.timeout(300)
def test_a_donor_killed_mid_transfer_makes_its_joiner_ask_again(kill_job):
    """The donor died once the size of the state went out: its joiner neither waited for the rest until a
    timeout nor failed, but asked again and got the state from another member."""
    status, _, output, _ = kill_job
    assert status == 0, output[-4000:]
    assert "rank 0 left the job before the fit's state arrived; it asks to rejoin again (attempt 2 of 3)" in output
    # and it took the state from the next member, in a membership epoch of its own (its lazily connected
    # group of the first attempt reached nobody but the dead donor: no member's exchange waits on it)
    asked = output.index("it asks to rejoin again (attempt 2 of 3)")
    second = re.search(r"rank 2: rejoined the job inside the epoch \(membership epoch \d+\).*", output[asked:])
    assert second and "from rank 0 " not in second.group(0), output[-3000:]


# -- the joiner's receive watches for the donor's departure ---------------------------------------------
class BlockedComm:
    """A `GroupComm` whose receives from the donor never end (a donor across a partition, or fenced, whose
    connection stays open): on gloo (`batched=False`) each blocks in the backend until `release`; on NCCL
    (`batched=True`) each polls `abandon` from the host, as `GroupComm._poll_batch` does."""

    rank = 2
    everyone = (0, 1, 2, 3)

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self.release = threading.Event()
        self.abandon = lambda members: False

    def point_to_point(self, tensor: torch.Tensor, peer: int, send: bool, operation: str) -> None:
        while not self.release.wait(0.01):
            if self.batched and self.abandon(self.everyone):
                raise CoordinationTimeout(f"rank 2: {operation} with rank {peer}: a member left the job")
        raise CoordinationTimeout(f"rank 2: {operation} with rank {peer} timed out")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batched", [False, True], ids=["gloo", "nccl"])
def test_a_joiner_gives_up_its_receive_as_soon_as_the_donor_leaves(batched):
    """Without the watch the receive would wait for the backend's timeout (here: until the test releases it)."""
    from lightning_prague.core.comm.transfer import receive_payload

    comm = BlockedComm(batched)
    departed: dict[int, str] = {}
    threading.Timer(0.3, lambda: departed.setdefault(0, "its process ended")).start()
    try:
        with pytest.raises(MemberLost, match="rank 0, which was sending it the fit's state, left the job"):
            receive_payload(comm, 0, "the fit's state", sender_gone=lambda: 0 in departed)  # type: ignore[arg-type]
    finally:
        comm.release.set()  # the receive left behind on gloo ends
    departed.clear()
    comm = BlockedComm(batched)
    comm.release.set()  # a receive that fails while the donor is still a member is that failure
    with pytest.raises(CoordinationTimeout, match="timed out"):
        receive_payload(comm, 0, "the fit's state", sender_gone=lambda: 0 in departed)  # type: ignore[arg-type]


# -- faults that strike a later process of a rank -----------------------------------------------------------
def test_a_fault_names_the_process_of_its_rank_it_strikes(monkeypatch):
    assert Fault.parse("2@1:1:kill-before-training") == Fault(2, 1, "kill-before-training", 0.0, 1)
    assert Fault.parse("0:3:kill-in-transfer").process == 0
    for bad in ("2@x:1:kill", "2@-1:1:kill", "2@1:0:kill"):
        with pytest.raises(ConfigurationError, match="PROCESS"):
            Fault.parse(bad)
    for variable in (RESTARTS_VARIABLE, REJOIN_VARIABLE, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(variable, raising=False)
    assert process_number() == 0
    monkeypatch.setenv(RESTARTS_VARIABLE, "2")
    assert process_number() == 2
    monkeypatch.delenv(RESTARTS_VARIABLE)
    monkeypatch.setenv(REJOIN_VARIABLE, "1")
    assert process_number() is None  # started by hand to rejoin: no fault strikes it


def test_a_joiner_that_gives_up_shuts_its_connections_of_that_group_and_no_listener():
    """What `Membership.rejoin` does with the connections a group build made: their peers see them end
    at once (a gloo operation with this process fails, as if it had ended); a listening socket stays."""
    import socket

    from lightning_prague.core.client.partition import established_connections, shut_down_connections

    with socket.create_server(("127.0.0.1", 0)) as listener:
        before = established_connections()
        mine = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        built = set(established_connections()) - set(before)
        assert len(built) == 2  # both ends live in this process here; a joiner holds one end of each pair
        try:
            mine_inode = os.fstat(mine.fileno()).st_ino
            assert shut_down_connections({mine_inode}, 2, "a test") == 1
            peer.settimeout(5)
            assert peer.recv(1) == b""  # the peer sees the connection end
            with socket.create_connection(listener.getsockname()) as again:  # the listener still accepts
                assert again.fileno() >= 0
        finally:
            mine.close()
            peer.close()
