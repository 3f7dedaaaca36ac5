"""Hostile clients against a real running 4-worker job: every rank's fit returns, and nothing runs.

While the job trains, a thread of the test connects to its control plane (the port fixed with
`LIGHTNING_PRAGUE_CONTROL_PORT`, as a port scanner or another user's job finds it) and, over and over
until the job ends, sends what a port scanner, a monitoring probe or an attacker would: an HTTP
request line, 64 KiB of random bytes, a hello for a live rank, a `join` whose config is a pickle
that would create a file if it were loaded, while `FLOOD` connections opened at once are held without
a byte. Each hostile connection must be closed by the plane; the job must finish as it would alone.

The job runs under descriptor limits of `JOB_DESCRIPTORS` (soft and hard; the supervisor raises its
soft limit to the hard one), and the idle connections are `FLOOD`, more than either: the plane sheds
the flood's oldest connections, never the ranks' (a flood past the limit once ended the supervisor,
and every fit with it).
"""

from __future__ import annotations

import base64
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers import NOFILE_VARIABLE, free_port, run_training

from lightning_prague.core.plane.server import raise_descriptor_limit
from lightning_prague.core.protocol import PORT_VARIABLE, encode_line

pytestmark = pytest.mark.timeout(240)

#: the job's soft and hard limits of open descriptors, and the idle connections held against them
JOB_DESCRIPTORS, FLOOD = "256:512", 1200


class _TouchesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


class Attacker(threading.Thread):
    """Sends the control plane at `port` what no rank would, until `stop` is set."""

    def __init__(self, port: int, marker: Path) -> None:
        super().__init__(name="attacker", daemon=True)
        self.port, self.marker = port, marker
        self.stop = threading.Event()
        self.rounds = 0
        self.kept: list[str] = []  # attacks whose connection the plane did not close
        self.idle: list[socket.socket] = []
        config = base64.b64encode(pickle.dumps(_TouchesAFile(marker))).decode()
        join = {"op": "join", "s": 1, "rank": 1, "config": config, "pid": -1, "host": socket.gethostname()}
        self.attacks = {
            "an HTTP request line": b"GET / HTTP/1.0\r\n\r\n",
            "64 KiB of random bytes": os.urandom(64 << 10),
            "a hello for a live rank": encode_line({"op": "hello", "rank": 1}),
            "a join with a pickled config": encode_line(join),
        }

    def _connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def run(self) -> None:
        while not self.stop.is_set():  # until the supervisor listens
            try:
                self._connect().close()
                break
            except OSError:
                time.sleep(0.05)
        self.idle = [self._connect() for _ in range(FLOOD)]  # opened at once, never a byte
        while not self.stop.is_set():
            for what, data in self.attacks.items():
                try:
                    with self._connect() as sock:
                        sock.sendall(data)
                        if not _closed_by_plane(sock):
                            self.kept.append(what)
                except (ConnectionRefusedError, OSError):
                    if self.stop.is_set():  # the job ended and its plane with it
                        return
            self.rounds += 1
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        self.join(30)
        for sock in self.idle:
            sock.close()


def _closed_by_plane(sock: socket.socket, timeout: float = 15.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("strategy", ["prague", "decent_adam"])
def test_every_rank_of_a_job_under_attack_finishes_and_nothing_runs(tmp_path, strategy):
    raise_descriptor_limit()  # this process holds the flood: its own soft limit may be lower
    port = free_port()
    marker = tmp_path / "pickle-ran"
    attacker = Attacker(port, marker)
    attacker.start()
    try:
        proc, result = run_training(
            tmp_path,
            "--strategy",
            strategy,
            "--devices",
            "4",
            "--epochs",
            "4",
            "--profile",
            "homogeneous",
            timeout=200,
            **{PORT_VARIABLE: str(port), NOFILE_VARIABLE: JOB_DESCRIPTORS},
        )
    finally:
        attacker.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result is not None and result["epochs_run"] == 4
    assert sum(result["batches_per_worker"]) > 0 and all(b > 0 for b in result["batches_per_worker"])
    assert attacker.rounds >= 1, "the job ended before one round of attacks"
    assert attacker.kept == []  # every hostile connection was closed by the plane
    assert not marker.exists()  # the pickle never ran
    assert "lightning-prague: the supervisor" in proc.stdout + proc.stderr  # its log's path, where users look
