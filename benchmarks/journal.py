"""What the control plane's journal costs: handling with and without it, its size, and a restart's replay.

    python benchmarks/journal.py                      # 8 ranks, 20,000 steps of the work queue and groups
    python benchmarks/journal.py --ranks 64 --steps 2000 --out bench-out/journal

In this process, no network: a `ControlPlane` behind a `JournaledPlane` handles what `--ranks` ranks
of a `prague` fit send per step (a claim of the work queue, a report of the chunk trained, a group
request, and a group sum's completeness for every group issued), once with no journal and once with
one (`lightning_prague.core.plane.journal`); then a plane started again reads the journal and replays
it. Reported: messages handled per second both ways, the journal's bytes per message, and the
replay's messages per second (how long a restart of a plane takes per hour of a fit).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from lightning_prague.core.grouping.policies import make_policy
from lightning_prague.core.plane.coordinator import ControlPlane
from lightning_prague.core.plane.journal import Journal, JournaledPlane, read_journal
from lightning_prague.core.protocol import MESSAGE_SEQ, SessionConfig


def drive(plane: JournaledPlane, ranks: int, steps: int) -> int:
    """A fit's traffic through `plane`; returns the messages handled."""
    config = SessionConfig(ranks, make_policy("random", ranks, 2, seed=1).spec()).to_wire()
    seq = dict.fromkeys(range(ranks), 0)
    sent = 0

    def send(rank: int, op: str, **fields) -> dict:
        nonlocal sent
        seq[rank] += 1
        sent += 1
        return plane.handle({"op": op, "s": 1, "rank": rank, MESSAGE_SEQ: seq[rank], **fields})

    for rank in range(ranks):
        plane.on_connect(rank, {"op": "hello", "rank": rank})
        send(rank, "join", config=config, pid=1000 + rank, host="bench")
    req = 0
    for _ in range(steps):
        for rank in range(ranks):
            req += 1
            (reply,) = [i for i in send(rank, "kv", do="claim", req=req, key="q", first=0, ticketed=0)[rank]]
            chunk = reply["value"][0]
            send(rank, "work", key="q", done=[chunk])
            out = send(rank, "ready", req=req)
            for item in out.get(rank, []):
                if item["t"] == "group":
                    for member in item["members"]:
                        send(member, "summed", key=f"g{item['gid']}", members=item["members"], ok=True)
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20_000, help="steps of every rank")
    parser.add_argument("--out", type=Path, help="write journal.json there")
    args = parser.parse_args()
    start = time.perf_counter()
    sent = drive(JournaledPlane(ControlPlane()), args.ranks, args.steps)
    bare = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "journal"
        start = time.perf_counter()
        drive(JournaledPlane(ControlPlane(), Journal(path, "bench")), args.ranks, args.steps)
        journaled = time.perf_counter() - start
        size = path.stat().st_size
        start = time.perf_counter()
        _, entries = read_journal(path, "bench")
        read = time.perf_counter() - start
        start = time.perf_counter()
        JournaledPlane(ControlPlane()).replay(entries)
        replayed = time.perf_counter() - start
    result = {
        "ranks": args.ranks,
        "messages": sent,
        "handled_per_s_without_journal": round(sent / bare),
        "handled_per_s_with_journal": round(sent / journaled),
        "journal_bytes_per_message": round(size / len(entries), 1),
        "journal_mb": round(size / 1e6, 1),
        "restart_read_s": round(read, 2),
        "restart_replay_s": round(replayed, 2),
        "restart_messages_per_s": round(len(entries) / (read + replayed)),
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "journal.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
