"""Who may talk to the control plane: the secret, the launch id, the listening interface, and what a
rank checks of the address the store holds before it connects (`lightning_prague.core.auth`,
`lightning_prague.core.plane.supervisor.listen_address`, `lightning_prague.core.job._connect`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from helpers import LAUNCH, free_port, process_alive

from lightning_prague.core import auth
from lightning_prague.core.auth import Credentials, known_launch_id, user_secret
from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout
from lightning_prague.core.job import _connect
from lightning_prague.core.plane.supervisor import CONTROL_HOST_VARIABLE, listen_address
from lightning_prague.core.protocol import SessionConfig
from lightning_prague.core.records import BadRecord

pytestmark = pytest.mark.timeout(60)

_LAUNCHERS = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_RESTART_COUNT",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        auth.SECRET_VARIABLE,
        auth.SECRET_FILE_VARIABLE,
        auth.LAUNCH_VARIABLE,
        CONTROL_HOST_VARIABLE,
        *_LAUNCHERS,
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_secret_comes_from_the_variable_or_a_private_file_and_must_be_long(clean_env, tmp_path):
    assert user_secret() is None  # none set: rank 0 generates one
    clean_env.setenv(auth.SECRET_VARIABLE, "  s3cret-of-the-job-123  ")
    assert user_secret() == b"s3cret-of-the-job-123"
    clean_env.setenv(auth.SECRET_VARIABLE, "short")
    with pytest.raises(ConfigurationError, match="has 5 characters; use at least 16"):
        user_secret()
    clean_env.delenv(auth.SECRET_VARIABLE)
    path = tmp_path / "secret"
    path.write_text("a-secret-from-a-file-0123\n")
    path.chmod(0o644)
    clean_env.setenv(auth.SECRET_FILE_VARIABLE, str(path))
    with pytest.raises(ConfigurationError, match=r"may be read by other users .*chmod 600"):
        user_secret()
    path.chmod(0o600)
    assert user_secret() == b"a-secret-from-a-file-0123"
    clean_env.setenv(auth.SECRET_FILE_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="cannot read the job's secret"):
        user_secret()


def test_the_launch_id_is_the_launchers_and_the_key_differs_per_launch(clean_env):
    assert known_launch_id() is None
    clean_env.setenv("SLURM_JOB_ID", "77")
    clean_env.setenv("SLURM_STEP_ID", "3")
    assert known_launch_id() == "slurm:77:0"  # the job's: a new step of it (a task started again) is the same job
    clean_env.setenv("SLURM_STEP_ID", "4")
    assert known_launch_id() == "slurm:77:0"
    clean_env.setenv("SLURM_RESTART_COUNT", "1")
    assert known_launch_id() == "slurm:77:1"  # a requeued job: a fresh fit
    clean_env.setenv("TORCHELASTIC_RUN_ID", "abc")
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert known_launch_id() == "torchrun:abc:2"
    clean_env.setenv(auth.LAUNCH_VARIABLE, "mine")
    assert known_launch_id() == "mine"
    clean_env.setenv(auth.LAUNCH_VARIABLE, "x" * 300)
    with pytest.raises(ConfigurationError, match="longer than 256"):
        known_launch_id()
    one, other = Credentials.derive(b"secret", "launch 1"), Credentials.derive(b"secret", "launch 2")
    assert one.key != other.key
    assert one.hello_proof("n", "m", 1) != one.welcome_proof("n", "m", 1) != one.hello_proof("n", "m", 2)


def test_the_plane_listens_on_master_addr_unless_told_otherwise(clean_env):
    assert listen_address("127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert listen_address("localhost") == ("localhost", "localhost")
    clean_env.setenv(CONTROL_HOST_VARIABLE, "0.0.0.0")
    assert listen_address("10.1.2.3") == ("", "10.1.2.3")  # every interface, still reached at MASTER_ADDR
    clean_env.setenv(CONTROL_HOST_VARIABLE, "10.9.9.9")
    assert listen_address("node1") == ("10.9.9.9", "10.9.9.9")


def test_a_host_name_that_resolves_to_a_loopback_address_listens_everywhere(clean_env, monkeypatch):
    # Debian's /etc/hosts maps the node's own name to 127.0.1.1; other nodes reach it at another address
    import socket

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(2, 1, 6, "", ("127.0.1.1", 0))])
    assert listen_address("node1") == ("", "node1")


@pytest.fixture
def store():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield store


def _publish(store, **record) -> None:
    base = {"host": "127.0.0.1", "port": 1, "pid": 4242, "launch": "launch-a", "secret": "ab" * 32}
    store.set("lightning_prague/control/0", json.dumps({**base, **record}))


def test_a_rank_refuses_an_address_of_another_launch_or_another_supervisor(store, clean_env):
    _publish(store)
    with pytest.raises(CoordinationTimeout, match="of launch 'launch-a', but this rank belongs to launch 'launch-b'"):
        _connect(store, 1, 5.0, None, None, "launch-b")
    with pytest.raises(CoordinationTimeout, match=r"not the supervisor this rank started \(pid 999\)"):
        _connect(store, 0, 5.0, SimpleNamespace(pid=999), None, "launch-a")
    _publish(store, secret=None)
    with pytest.raises(CoordinationTimeout, match="is not a control plane's address"):
        _connect(store, 1, 5.0, None, None, None)
    _publish(store, port="1; rm -rf /")
    with pytest.raises(CoordinationTimeout, match="field 'port'"):
        _connect(store, 1, 5.0, None, None, None)
    store.set("lightning_prague/control/0", json.dumps({"host": "h", "port": 1, "pid": 4242, "launch": "launch-a"}))
    with pytest.raises(ConfigurationError, match="set on rank 0 but not on this rank"):
        _connect(store, 1, 5.0, None, None, None)


def test_a_session_configuration_is_checked_field_by_field():
    from lightning_prague.core.grouping.policies import make_policy

    wire = SessionConfig(4, make_policy("random", 4, 2).spec(), timeout=60.0).to_wire()
    assert SessionConfig.from_wire(json.loads(json.dumps(wire))).to_wire() == wire
    sharded = SessionConfig(4, make_policy("random", 4, 2).spec(), replica_size=2, shard=True).to_wire()
    assert SessionConfig.from_wire(json.loads(json.dumps(sharded))).shard is True
    for field, value, expected in [
        ("timeout", "300", "field 'timeout'"),
        ("world_size", 0, "field 'world_size'"),
        ("hang", {"floor": -1}, "field 'floor'"),
        ("hang", {"import": "os"}, "unknown field 'import'"),
        ("policy", "gASV", "field 'policy'"),
        ("exec", "print(1)", "unknown field 'exec'"),
        ("replica_size", 0, "field 'replica_size'"),
        ("replica_size", 3, "replica_size=3 does not divide world_size=4"),
        ("shard", "yes", "field 'shard'"),
    ]:
        with pytest.raises(BadRecord, match=expected):
            SessionConfig.from_wire({**wire, field: value})


def test_the_supervisor_goes_when_the_process_that_launched_it_is_gone(tmp_path):
    """Not a lingering process on MASTER_PORT for the rendezvous' whole bound: its launcher died."""
    port = free_port()
    package = str(Path(auth.__file__).resolve().parents[1])
    script = textwrap.dedent(
        f"""
        import sys, types
        p = types.ModuleType("lightning_prague"); p.__path__ = [{package!r}]; sys.modules["lightning_prague"] = p
        from lightning_prague.core.plane.launch import launch, wait_until_listening
        handle = launch("127.0.0.1", {port}, 2, 1.0, True, secret={LAUNCH["secret"]!r}, launch_id="t",
                        publish_secret=True, wait=600.0)
        wait_until_listening(handle, "127.0.0.1", {port}, 30)
        print(handle.pid, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=os.environ)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(pid)


def test_a_job_of_several_nodes_without_a_secret_of_its_own_is_told_which_setting_to_use(monkeypatch, tmp_path):
    monkeypatch.delenv(auth.SECRET_VARIABLE, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_VARIABLE, raising=False)
    assert auth.secret_advice(1) is None  # one node: the store is on this machine's loopback by default
    advice = auth.secret_advice(4)
    assert advice is not None and "4 nodes" in advice
    assert auth.SECRET_FILE_VARIABLE in advice and auth.SECRET_VARIABLE in advice
    secret = tmp_path / "secret"
    secret.write_text("x" * 44)
    secret.chmod(0o600)
    monkeypatch.setenv(auth.SECRET_FILE_VARIABLE, str(secret))
    assert auth.secret_advice(4) is None
