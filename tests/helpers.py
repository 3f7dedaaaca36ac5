"""Launching multi-process runs from tests: free ports, timeouts, JSON results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"})
    out.pop("LOCAL_RANK", None)
    out.update(extra)
    return out


def run_core_ranks(
    tmp: Path, world: int, *args: str, timeout: float = 90, script: str = "core_worker.py", **extra_env: str
) -> list[dict]:
    """Run ``scripts/<script>`` (default ``core_worker.py``) on ``world`` ranks; return their JSON results."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPTS / script),
                str(r),
                str(world),
                str(port),
                str(tmp / f"r{r}.json"),
                *args,
            ],
            env=env(**extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-3000:]}"
    return [json.loads((tmp / f"r{r}.json").read_text()) for r in range(world)]


def run_training(tmp: Path, *args: str, timeout: float = 240, script: str = "train.py", **extra_env: str):
    """Run a Lightning training script (which launches its own ranks); return (completed process, rank-0 JSON)."""
    out_json = tmp / "result.json"
    cmd = [sys.executable, str(SCRIPTS / script), "--json", str(out_json), *args]
    proc = subprocess.run(cmd, env=env(**extra_env), cwd=tmp, capture_output=True, text=True, timeout=timeout)
    result = json.loads(out_json.read_text()) if out_json.exists() else None
    return proc, result


def rank_results(tmp: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp.glob("result.rank*.json"))]
