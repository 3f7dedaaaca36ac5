"""The supervisor: a process of its own that hosts the job's control plane (and usually its store).

Global rank 0 starts it at set-up (`launch`), before the process group exists, so no training
process hosts anything the others need: any worker, rank 0 included, may die and the survivors
still reach the store and the coordinator, which tells them who is gone. It

* hosts the job's TCPStore at `MASTER_ADDR:MASTER_PORT` (every training rank is a client, as under
  torchrun's agent), unless a store is already there (torchrun's agent store, or a process group
  that was initialised before): then it is a client of that store;
* serves the control plane (`ControlPlane` behind a `MessageServer`) on every interface, on a
  free port or a fixed one for firewalls (the strategies' `coordinator_port`, given to `launch`
  as `control_port`, or the `LIGHTNING_PRAGUE_CONTROL_PORT` environment variable), and publishes
  `MASTER_ADDR:port` in the store (key `ADDRESS_KEY`): every rank can reach that host, since the
  store is there;
* exits by itself once every rank of the job has connected and all of them have closed their
  connections (the job ended, or every worker is gone), or when no rank is connected `timeout`
  seconds after it started. It runs in a session of its own (a signal for rank 0's process group
  does not reach it) and needs nothing but torch and the core of this package (it never imports
  Lightning).

Where the launching process has not initialised CUDA (CPU jobs), the supervisor is forked from it:
it starts at once, with nothing to import (on two cores, a fresh interpreter's `import torch`
costs every job a few seconds of start-up). A process that holds a CUDA context must not fork, so
there it is a fresh interpreter (`python -c BOOTSTRAP`), which imports only the core.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

#: the store key (no prefix, suffixed with torchelastic's restart count) that holds `host:port:pid`
ADDRESS_KEY = "lightning_prague/control"
#: environment variable: a fixed port for the control plane (default: a free one)
PORT_VARIABLE = "LIGHTNING_PRAGUE_CONTROL_PORT"

log = logging.getLogger(__name__)

# Run as `python -c BOOTSTRAP`: the package's __init__ (which imports Lightning to register the
# strategies) is skipped; only the core is imported.
BOOTSTRAP = (
    "import sys, types; "
    "p = types.ModuleType('lightning_prague'); p.__path__ = [sys.argv[1]]; sys.modules['lightning_prague'] = p; "
    "from lightning_prague.core.supervisor import main; main(sys.argv[2:])"
)


def resolve_control_port(control_port: int | None = None) -> int | None:
    """The control plane's port: `control_port`, else `PORT_VARIABLE`'s, else `None` (a free one).

    Raises `ConfigurationError` for a port outside 1-65535, a variable that is not one, or both
    set to different ports.
    """
    from lightning_prague.core.errors import ConfigurationError

    if control_port is not None and (
        isinstance(control_port, bool) or not isinstance(control_port, int) or not 1 <= control_port <= 65535
    ):
        raise ConfigurationError(
            f"coordinator_port={control_port!r} is invalid: it must be a TCP port number from 1 to 65535 "
            "(or unset for a free port)"
        )
    value = os.environ.get(PORT_VARIABLE, "").strip()
    if not value:
        return control_port
    try:
        env_port = int(value)
    except ValueError:
        env_port = 0
    if not 1 <= env_port <= 65535:
        raise ConfigurationError(
            f"{PORT_VARIABLE}={value!r} is invalid: it must be a TCP port number from 1 to 65535 (or unset)"
        )
    if control_port is not None and control_port != env_port:
        raise ConfigurationError(
            f"coordinator_port={control_port} and {PORT_VARIABLE}={env_port} name different ports for the control "
            f"plane: set only one of them (or both to the same port)"
        )
    return env_port


def address_key() -> str:
    """The key of this launch attempt (torchrun restarts workers under the same agent store)."""
    return f"{ADDRESS_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Supervisor:
    """The launching process's handle on the supervisor: its pid, `poll()` and its log file."""

    def __init__(self, pid: int, log_file: Path, proc: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.log_file = log_file
        self._proc = proc
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the supervisor ended (reaped here), else `None`."""
        if self.returncode is None:
            if self._proc is not None:
                self.returncode = self._proc.poll()
            else:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere
                    return None
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def output(self) -> str:
        try:
            return self.log_file.read_text()[-3000:]
        except OSError:
            return ""


def launch(
    host: str, port: int, world_size: int, timeout: float, host_store: bool, control_port: int | None = None
) -> Supervisor:
    """Start the supervisor for a job of `world_size` ranks whose store is (to be) at `host:port`.

    It serves the control plane on `control_port` (see `resolve_control_port`; unset: a free port).
    """
    control_port = resolve_control_port(control_port)
    log_file = Path(tempfile.gettempdir()) / f"lightning_prague-supervisor-{port}.log"
    argv = ["--host", host, "--port", str(port), "--world-size", str(world_size), "--timeout", str(timeout)]
    argv += ["--log", str(log_file)] + (["--host-store"] if host_store else [])
    argv += ["--control-port", str(control_port or 0)]
    if hasattr(os, "fork") and not _cuda_initialized():
        handle = _fork(argv, log_file)
    else:
        package = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(log_file, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, package, *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
                env=env,
            )
        handle = Supervisor(proc.pid, log_file, proc)
    log.debug(
        "started the supervisor (pid %d) for %d ranks, store at %s:%d, control plane port %s",
        handle.pid,
        world_size,
        host,
        port,
        control_port or "free",
    )
    return handle


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _fork(argv: list[str], log_file: Path) -> Supervisor:
    """Fork the supervisor from this process (see the module docstring)."""
    import gc

    gc.freeze()  # what exists now stays shared with the child instead of being copied by its collector
    pid = os.fork()
    if pid:
        gc.unfreeze()
        return Supervisor(pid, log_file)
    status = 1
    try:
        os.setsid()
        with open(log_file, "w") as err, open(os.devnull, "rb+") as null:
            os.dup2(null.fileno(), 0)
            os.dup2(null.fileno(), 1)
            os.dup2(err.fileno(), 2)
        for handler in list(logging.root.handlers):  # the parent's handlers write where it does
            logging.root.removeHandler(handler)
        main(argv)
        status = 0
    finally:
        os._exit(status)


def wait_until_listening(proc: Supervisor, host: str, port: int, timeout: float) -> None:
    """Return once the supervisor's store accepts connections; raise if the supervisor ended first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            from lightning_prague.core.errors import CoordinationTimeout

            raise CoordinationTimeout(
                f"rank 0: the supervisor (the process that hosts the store and the control plane at {host}:{port}) "
                f"exited with status {proc.returncode} at start-up:\n{proc.output()}"
            )
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                from lightning_prague.core.errors import CoordinationTimeout

                raise CoordinationTimeout(
                    f"rank 0: the supervisor did not listen at {host}:{port} within {timeout:.0f}s"
                ) from None
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="lightning-prague's supervisor (started by global rank 0)")
    parser.add_argument("--host", required=True, help="MASTER_ADDR: where the ranks reach this node")
    parser.add_argument("--port", type=int, required=True, help="MASTER_PORT: the store's port")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--host-store", action="store_true", help="host the TCPStore (else: be a client)")
    parser.add_argument(
        "--control-port", type=int, help=f"the control plane's port (0: a free one; unset: {PORT_VARIABLE} or 0)"
    )
    parser.add_argument("--log", help="this process's log file, deleted at a clean exit")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LIGHTNING_PRAGUE_SUPERVISOR_LOG", "WARNING"),
        format=f"supervisor[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    import torch.distributed as dist

    from lightning_prague.core.coordinator import ControlPlane
    from lightning_prague.core.transport import MessageServer

    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore(
        args.host, args.port, args.world_size, is_master=args.host_store, timeout=timeout, wait_for_workers=False
    )
    plane = ControlPlane()
    server = MessageServer(
        plane.handle,
        "",
        name="prague-control-plane",
        port=args.control_port if args.control_port is not None else int(os.environ.get(PORT_VARIABLE, "0")),
        on_connect=plane.on_connect,
        on_disconnect=plane.on_disconnect,
        on_tick=plane.tick,
    )
    server.start()
    store.set(address_key(), f"{args.host}:{server.address[1]}:{os.getpid()}")
    log.info(
        "serving %d ranks: store %s:%d, control plane port %d", args.world_size, args.host, args.port, server.address[1]
    )
    started = time.monotonic()
    while server.alive:
        time.sleep(0.05)
        if server.connected:
            continue
        everyone_came = len(server.ever_connected) >= args.world_size
        if everyone_came or time.monotonic() - started > args.timeout:
            break
    server.close()
    log.info("exiting: %d of %d ranks came and all are gone", len(server.ever_connected), args.world_size)
    if args.log and server.error is None:
        try:
            os.unlink(args.log)
        except OSError:
            pass
    os._exit(0 if server.error is None else 1)  # the store's threads must not hold the exit


if __name__ == "__main__":
    main()
