"""Which admissions a rank sends the fit's state for, and when (`GroupWorker.donate`'s `upto`).

The ranks of a replica sharded over them each send the joiner of their own index its shard
(`donors`); they must send shards of one moment, so a rank holds an admission's state until its
replica agrees on it (`DonationAgreement`). These tests run the worker's bookkeeping with a stand-in
session and job: what is sent, to whom, and what is held; the transfers themselves are tested in
`tests/test_rejoin.py` and the whole path in `tests/test_replica_comeback.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

from lightning_prague.core.exchange.worker import GroupWorker


class _Session:
    def __init__(self, rank: int, admissions: list[dict]) -> None:
        self.rank, self.world_size = rank, 6
        self.admissions = admissions
        self.departed: dict[int, str] = {}
        self.rejoined: dict[int, tuple[float, str]] = {}
        self.announced_epoch = max((int(item["epoch"]) for item in admissions), default=0)

    def take_admissions(self, inside_only: bool = False) -> list[dict]:
        taken, self.admissions = self.admissions, []
        return taken

    def departed_for(self, epoch: int) -> set[int]:
        return set(self.departed)


def _worker(rank: int, admissions: list[dict]) -> tuple[GroupWorker, list[tuple[int, list[int]]]]:
    worker = object.__new__(GroupWorker)
    worker.session = _Session(rank, admissions)  # type: ignore[assignment]
    worker.rank = rank
    worker.job = SimpleNamespace(epoch_group=lambda epoch, members, departed: f"group{epoch}")  # type: ignore[assignment]
    worker._held = []
    sent: list[tuple[int, list[int]]] = []
    worker._send_state = lambda snapshot, epoch, members, receivers, since: sent.append((epoch, receivers))  # type: ignore[method-assign]
    return worker, sent


def _admission(epoch: int, joined: list[int], donors: list[list[int]]) -> dict:
    return {
        "t": "members",
        "epoch": epoch,
        "members": list(range(6)),
        "joined": joined,
        "donor": donors[0][1],
        "donors": donors,
    }


def test_a_rank_sends_only_the_joiners_it_is_the_donor_of():
    admissions = [_admission(1, [2, 3], [[2, 0], [3, 1]])]
    worker, sent = _worker(1, admissions)
    assert worker.donate(lambda: lambda: b"") == [2, 3]
    assert sent == [(1, [3])]  # rank 1 holds shard 1: joiner 3's
    worker, sent = _worker(4, [_admission(1, [2, 3], [[2, 0], [3, 1]])])
    assert worker.donate(lambda: lambda: b"") == [2, 3] and sent == []  # another replica: it only follows


def test_a_sharded_donor_holds_each_admission_until_its_replica_agrees_on_its_epoch():
    worker, sent = _worker(0, [_admission(1, [2, 3], [[2, 0], [3, 1]]), _admission(2, [4, 5], [[4, 0], [5, 1]])])
    assert worker.donate(lambda: lambda: b"", upto=0) == [2, 3, 4, 5]
    assert sent == [] and [held[0] for held in worker._held] == [1, 2], "the replica agreed on nothing yet"
    assert worker.donate(lambda: lambda: b"", upto=1) == [] and sent == [(1, [2])]
    assert worker.donate(lambda: lambda: b"") == [] and sent == [(1, [2]), (2, [4])]  # (inside a meeting: all)
    assert worker._held == []
    assert worker.newest_epoch() == 2
