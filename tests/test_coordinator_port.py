"""`coordinator_port`: global rank 0's supervisor serves the control plane on the chosen port.

One supervisor of a one-rank job, started here (forked: a second or so), and the strategy's
hand-over to `init_job` (stubbed: no process group is created in the test process).
"""

from __future__ import annotations

import time
from datetime import timedelta

import lightning as L
import pytest
import torch.distributed as dist
from helpers import LAUNCH, free_port, plane_credentials

from lightning_prague import ConfigurationError, PartialAllReduceStrategy
from lightning_prague.core.client.control import ControlClient
from lightning_prague.core.plane.launch import launch, wait_until_listening
from lightning_prague.core.protocol import PORT_VARIABLE, address_key
from lightning_prague.strategies import base


def _two_free_ports() -> tuple[int, int]:
    store_port = free_port()
    control_port = free_port()
    while control_port == store_port:
        control_port = free_port()
    return store_port, control_port


def _published_control_port(handle, store_port: int) -> int:
    """The port the supervisor published; then a rank comes and goes, so that it exits."""
    wait_until_listening(handle, "127.0.0.1", store_port, timeout=30)
    store = dist.TCPStore(
        "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    store.wait([address_key()], timedelta(seconds=30))
    host, port, pid, credentials = plane_credentials(store, address_key())
    assert (host, pid) == ("127.0.0.1", handle.pid)
    client = ControlClient(host, port, 0, timeout=10, credentials=credentials)  # reachable on that port
    client.close()
    deadline = time.monotonic() + 15
    while handle.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handle.poll() == 0, handle.output()
    return int(port)


@pytest.mark.parametrize("given_by", ["option", "environment"])
def test_the_supervisor_serves_the_control_plane_on_the_chosen_port(given_by, monkeypatch):
    store_port, control_port = _two_free_ports()
    if given_by == "option":
        monkeypatch.delenv(PORT_VARIABLE, raising=False)
        handle = launch("127.0.0.1", store_port, 1, timeout=30.0, host_store=True, control_port=control_port, **LAUNCH)
    else:
        monkeypatch.setenv(PORT_VARIABLE, str(control_port))
        handle = launch("127.0.0.1", store_port, 1, timeout=30.0, host_store=True, **LAUNCH)
    assert _published_control_port(handle, store_port) == control_port


def test_a_port_that_disagrees_with_the_environment_starts_no_supervisor(monkeypatch):
    store_port, control_port = _two_free_ports()
    monkeypatch.setenv(PORT_VARIABLE, str(control_port))
    with pytest.raises(ConfigurationError, match=f"coordinator_port=1 and {PORT_VARIABLE}={control_port}"):
        launch("127.0.0.1", store_port, 1, timeout=30.0, host_store=True, control_port=1, **LAUNCH)


def test_the_strategy_hands_its_port_to_init_job(monkeypatch):
    calls = []

    class Stop(Exception):
        pass

    def fake_init_job(*args, **kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.delenv(PORT_VARIABLE, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # restored afterwards: setup_distributed sets them
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(base, "init_job", fake_init_job)
    strategy = PartialAllReduceStrategy(group_size=2, coordinator_port=29517)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
    with pytest.raises(Stop):
        strategy.setup_distributed()
    assert calls and calls[0]["control_port"] == 29517
