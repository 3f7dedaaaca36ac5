"""Load test of the control plane alone: group formations and work-queue claims per second at N workers.

    python benchmarks/coordinator_load.py                       # N = 8, 64, 256, 1024, random groups of 3
    python benchmarks/coordinator_load.py --sizes 256 --policy first_ready --seconds 10
    python benchmarks/coordinator_load.py --sizes 256 --mode claims

The real :class:`~lightning_prague.core.ControlPlane` runs behind the real
:class:`~lightning_prague.core.plane.server.MessageServer` in this process, as in the supervisor
(no TCPStore: its address is passed to the clients directly). Simulated workers run in a few
forked client processes: each opens one connection per rank it simulates, sends ``hello`` and
``join`` (one session, one :class:`~lightning_prague.core.SessionConfig` with the policy of
``--policy``), then keeps one request outstanding, sending its next one as soon as the answer
arrives (or ``--think`` seconds later). Two measurements, each on a fresh server and session
(``--mode``):

* ``groups``: each request is a ``ready`` (the messages of
  :meth:`~lightning_prague.core.GroupWorker.partial_sync`, without the tensors); reported:
  group formations and requests per second, request latency (to the rank's ``answer``) and the
  server's messages and socket writes per request;
* ``claims``: each request is a work-queue claim, ``kv`` ``add`` of 1 to the session counter
  ``epoch/0/cursor`` (what :class:`~lightning_prague.core.WorkQueueSampler` does per chunk);
  reported: claims per second (the counter's growth) and claim latency (to the ``reply``).

The clients never pause by default, so this measures how many requests the control plane can
serve, not a training job. Latencies count requests sent in the measured window only.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import select
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Any

from lightning_prague.core import ControlPlane, SessionConfig, make_policy
from lightning_prague.core.auth import Credentials, new_nonce
from lightning_prague.core.plane.server import MessageServer
from lightning_prague.core.protocol import HELLO, WELCOME, encode_line

#: the launch's credentials, the plane's and every simulated rank's (the clients are forked: the same)
CREDENTIALS = Credentials.generate()
SESSION = 1  # the session number every simulated rank joins
CURSOR = "epoch/0/cursor"  # the work queue's claim counter of epoch 0
MODES = ("groups", "claims")
GROUP_PREFIX = b'{"t":"group"'  # how `encode_line` writes a group item


def _send(sock: socket.socket, data: bytes) -> None:
    """Write all of `data` to a non-blocking socket (one call, unless the kernel buffer is full)."""
    while data:
        try:
            data = data[sock.send(data) :]
        except BlockingIOError:
            select.select([], [sock], [], 60)


def _authenticate(sock: socket.socket, rank: int) -> bytes:
    """The handshake a rank's link makes (`lightning_prague.core.auth`): answer the plane's challenge
    with this benchmark's credentials, and take its welcome; returns what came after the welcome."""
    buffer = b""

    def line() -> dict[str, Any]:
        nonlocal buffer
        while b"\n" not in buffer:
            data = sock.recv(1 << 16)
            if not data:
                raise RuntimeError(f"rank {rank}: the control plane closed the connection in the handshake")
            buffer += data
        first, buffer = buffer.split(b"\n", 1)
        return json.loads(first)

    challenge = line()
    nonce = new_nonce()
    proof = CREDENTIALS.hello_proof(challenge["nonce"], nonce, rank)
    sock.sendall(encode_line({"op": HELLO, "rank": rank, "nonce": nonce, "proof": proof}))
    welcome = line()
    if welcome.get("t") != WELCOME:
        raise RuntimeError(f"rank {rank}: the control plane refused the handshake: {welcome}")
    return buffer


def _client_process(
    host: str, port: int, config: dict[str, Any], ranks: list[int], mode: str, stop: Any, think: float, out: str
) -> None:
    """Closed-loop clients for ``ranks`` in one event loop: each keeps one request outstanding and
    sends its next one ``think`` seconds after its answer (a training step; 0: at once), until
    ``stop`` is set. Writes ``[[sent, latency], ...]`` (``time.monotonic``, system-wide) to ``out``."""
    selector = selectors.DefaultSelector()
    state: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        sock = socket.create_connection((host, port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffered = _authenticate(sock, rank)
        join = {"op": "join", "s": SESSION, "rank": rank, "config": config, "pid": os.getpid(), "host": "load"}
        sock.sendall(encode_line(join))
        sock.setblocking(False)
        state[rank] = {"sock": sock, "req": 0, "sent": 0.0, "buf": buffered}
        selector.register(sock, selectors.EVENT_READ, rank)
    samples: list[tuple[float, float]] = []
    answer = "answer" if mode == "groups" else "reply"

    def ask(rank: int) -> None:
        entry = state[rank]
        entry["req"] += 1
        entry["sent"] = time.monotonic()
        message: dict[str, Any] = {"s": SESSION, "rank": rank, "req": entry["req"]}
        if mode == "groups":  # what GroupWorker.partial_sync sends
            message.update(op="ready", version=0)
        else:  # a work-queue claim, as WorkQueueSampler's Counters.add sends it
            message.update(op="kv", do="add", key=CURSOR, amount=1)
        _send(entry["sock"], encode_line(message))

    due: list[tuple[float, int]] = []  # (when, rank): requests waiting for their think time
    for i, rank in enumerate(ranks):
        heapq.heappush(due, (time.monotonic() + think * i / len(ranks), rank))
    checked = 0.0
    while True:
        now = time.monotonic()
        if now - checked > 0.05:
            checked = now
            if stop.is_set():
                break
        while due and due[0][0] <= now:
            ask(heapq.heappop(due)[1])
        wait = min(0.05, max(0.0, due[0][0] - now)) if due else 0.05
        for key, _ in selector.select(timeout=wait):
            rank = key.data
            entry = state[rank]
            try:
                data = entry["sock"].recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                raise RuntimeError(f"rank {rank}: the control plane closed the connection")
            lines = (entry["buf"] + data).split(b"\n")
            entry["buf"] = lines.pop()
            for line in lines:
                if line.startswith(GROUP_PREFIX):  # a group of the rank: nothing to do without tensors
                    continue
                item = json.loads(line)
                if item["t"] == "error" or "error" in item:
                    raise RuntimeError(f"rank {rank}: the control plane answered {item}")
                if item["t"] == answer and item["req"] == entry["req"]:
                    done = time.monotonic()
                    samples.append((entry["sent"], done - entry["sent"]))
                    if think > 0:
                        heapq.heappush(due, (done + think, rank))
                    else:
                        ask(rank)
    # leave the session cleanly (no departures to announce): `close`, then read until the server
    # closes too (a socket closed with unread data resets the connection, which loses the `close`)
    for rank, entry in state.items():
        entry["sock"].setblocking(True)
        entry["sock"].settimeout(60)
        entry["sock"].sendall(encode_line({"op": "close", "s": SESSION, "rank": rank}))
        entry["sock"].shutdown(socket.SHUT_WR)
    for entry in state.values():
        while entry["sock"].recv(1 << 20):
            pass
        entry["sock"].close()
    Path(out).write_text(json.dumps(samples))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def measure(world: int, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One run of ``mode`` at ``world`` simulated ranks, on a fresh control plane."""
    kwargs = {"mixing_window": 10 * world} if args.policy == "first_ready" else {}
    policy = make_policy(args.policy, world, min(args.group_size, world), seed=0, **kwargs)
    config = SessionConfig(world, policy.spec(), avoid_stragglers=True).to_wire()
    plane = ControlPlane()
    server = MessageServer(
        plane.handle,
        "127.0.0.1",
        CREDENTIALS,
        name="load-control-plane",
        on_connect=plane.on_connect,
        on_disconnect=plane.on_disconnect,
    )
    host, port = server.address
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    outs = [str(tmp / f"lat-{mode}-{world}-{p}.json") for p in range(args.processes)]
    procs = [
        ctx.Process(
            target=_client_process,
            args=(host, port, config, list(range(p, world, args.processes)), mode, stop, args.think, outs[p]),
        )
        for p in range(args.processes)
    ]
    for p in procs:  # before the server's thread starts: the clients fork from a single-threaded process
        p.start()
    server.start()
    deadline = time.monotonic() + 120
    while True:  # every rank joined (and the clients started asking)
        session = plane.sessions.get(SESSION)
        if session is not None and len(session.members) == world:
            break
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs) or server.error is not None:
            stop.set()
            raise RuntimeError(f"N={world}: the clients did not join the session (server error: {server.error})")
        time.sleep(0.01)
    time.sleep(args.warmup)
    groups_before, claims_before = session.generator.next_gid, int(session.values.get(CURSOR, 0))
    handled_before, writes_before = plane.handled, server.writes
    messages_before = server.messages_in + server.messages_out
    start = time.monotonic()
    time.sleep(args.seconds)
    end = time.monotonic()
    elapsed = end - start
    groups, claims = session.generator.next_gid - groups_before, int(session.values.get(CURSOR, 0)) - claims_before
    handled, writes = plane.handled - handled_before, server.writes - writes_before
    messages = server.messages_in + server.messages_out - messages_before
    stop.set()
    for p in procs:
        p.join(120)
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    server.close()
    if failed or server.error is not None:
        raise RuntimeError(f"N={world} {mode}: client processes {failed} failed (server error: {server.error})")
    samples = [s for o in outs for s in json.loads(Path(o).read_text())]
    latencies = [lat for sent, lat in samples if start <= sent < end]
    if mode == "groups":
        return {
            "formations_per_s": groups / elapsed,
            "requests_per_s": handled / elapsed,
            "latency_p50_ms": 1000 * _percentile(latencies, 0.5),
            "latency_p99_ms": 1000 * _percentile(latencies, 0.99),
            "messages_per_request": messages / max(handled, 1),
            "writes_per_request": writes / max(handled, 1),
        }
    return {
        "claims_per_s": claims / elapsed,
        "claim_latency_p50_ms": 1000 * _percentile(latencies, 0.5),
        "claim_latency_p99_ms": 1000 * _percentile(latencies, 0.99),
    }


def _row(world: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"workers": world, "policy": args.policy, "think_s": args.think}
    for key in ("formations_per_s", "requests_per_s", "latency_p50_ms", "latency_p99_ms"):
        row[key] = None
    row.update(messages_per_request=None, writes_per_request=None)
    row.update(claims_per_s=None, claim_latency_p50_ms=None, claim_latency_p99_ms=None)
    for mode in MODES:
        if args.mode in (mode, "both"):
            row.update(measure(world, mode, args, tmp))
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| N | policy | formations/s | requests/s | latency p50 / p99 (ms) | messages / writes per request "
        "| claims/s | claim latency p50 / p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['policy']} | {_fmt(r['formations_per_s'], '.0f')} | "
            f"{_fmt(r['requests_per_s'], '.0f')} | "
            f"{_fmt(r['latency_p50_ms'], '.2f')} / {_fmt(r['latency_p99_ms'], '.2f')} | "
            f"{_fmt(r['messages_per_request'], '.2f')} / {_fmt(r['writes_per_request'], '.2f')} | "
            f"{_fmt(r['claims_per_s'], '.0f')} | "
            f"{_fmt(r['claim_latency_p50_ms'], '.2f')} / {_fmt(r['claim_latency_p99_ms'], '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--policy", default="random", choices=["random", "buffer", "division", "first_ready"])
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--mode", default="both", choices=[*MODES, "both"], help="what to measure (default: both)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured window (s)")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--think", type=float, default=0.0, help="seconds each simulated worker computes between requests (0: saturate)"
    )
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--out", type=Path, default=Path("bench-out/coordinator-load"))
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes):
        parser.error("--sizes: every size must be at least 2 workers")
    if args.seconds <= 0 or args.warmup < 0 or args.think < 0 or args.processes < 1:
        parser.error("--seconds must be positive, --warmup and --think not negative, --processes at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [_row(n, args, args.out) for n in args.sizes]
    print(table(rows))
    (args.out / "coordinator_load.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
