"""Starting the supervisor: runs in global rank 0's training process, once, at set-up.

The supervisor (`lightning_prague.core.plane.supervisor`) is a process of its own; this module is
the launching process's side of it: start it (forked where that is safe, else a fresh interpreter
that imports only the core), wait until its store listens, and keep a handle on it (`Supervisor`).

Where the launching process has not initialised CUDA (CPU jobs), the supervisor is forked from it:
it starts at once, with nothing to import (on two cores, a fresh interpreter's `import torch`
costs every job a few seconds of start-up). A process that holds a CUDA context must not fork, so
there it is a fresh interpreter (`python -c BOOTSTRAP`), which imports only the core.

Either way the supervisor holds none of the launching process's file descriptors (rank 0's gloo
sockets when the process group was initialised first, its store connection, its files): a fresh
interpreter inherits none (`close_fds`), and a forked one lets go of every one but its standard
streams at once (`release_inherited_descriptors`), so that it keeps no connection of rank 0 open
after rank 0 is gone, and no file of its open after the job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import resource
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_prague.core.auth import SECRET_VARIABLE
from lightning_prague.core.errors import CoordinationTimeout
from lightning_prague.core.forking import cuda_initialized
from lightning_prague.core.plane.journal import journal_in_use
from lightning_prague.core.plane.supervisor import main
from lightning_prague.core.protocol import resolve_control_port

log = logging.getLogger(__name__)

#: environment variable: the folder the supervisor's log goes to and stays in (on the first node);
#: unset: the strategies' `<default_root_dir>/lightning_prague_logs`, or for `init_job` alone a temporary
#: file that is deleted when the supervisor exits cleanly
LOG_DIR_VARIABLE = "LIGHTNING_PRAGUE_LOG_DIR"

# Run as `python -c BOOTSTRAP`: the package's __init__ (which imports Lightning to register the
# strategies) is skipped; only the core is imported.
BOOTSTRAP = (
    "import sys, types; "
    "p = types.ModuleType('lightning_prague'); p.__path__ = [sys.argv[1]]; sys.modules['lightning_prague'] = p; "
    "from lightning_prague.core.plane.supervisor import main; main(sys.argv[2:])"
)


class Supervisor:
    """A handle on the supervisor: its pid, whether it died (`dead()`), its log file, and what it takes
    to start it again (`restart`).

    Global rank 0's first process holds the handle of the supervisor it started (its child). A later
    process of global rank 0 (one that rejoined the running fit) holds one it adopted (`adopt`): the
    supervisor is not its child, so whether it died is read from its journal's lock
    (`lightning_prague.core.plane.journal.journal_in_use`), which a dead process no longer holds."""

    def __init__(
        self, pid: int, log_file: Path, proc: subprocess.Popen | None = None, *, adopted: bool = False
    ) -> None:
        self.pid = pid
        self.log_file = log_file
        self._proc = proc
        self.returncode: int | None = None
        #: not this process's child: started by an earlier process of global rank 0
        self.adopted = adopted
        #: its command line and the job's secret, to start it again (`restart`)
        self.argv: list[str] = []
        self.secret = b""
        #: its journal (`--journal`), whose lock a live supervisor holds
        self.journal: Path | None = None
        #: times it was started again after it died
        self.restarts = 0

    def dead(self) -> bool:
        """Whether the supervisor ended: its exit status (a child), else its journal's lock is free (one
        adopted; `False` where no lock file is on this machine: it runs elsewhere, or never journaled)."""
        if self._proc is not None or not self.adopted:
            return self.poll() is not None
        return self.journal is not None and journal_in_use(self.journal) is False

    def restart(self, control_port: int) -> None:
        """Start the supervisor again after it died (a fresh interpreter: this process trains, with
        threads that a fork would copy mid-operation), on the same store port and `control_port`, to take
        the running job back from its journal (`lightning_prague.core.plane.journal`)."""
        argv = [*self.argv, "--control-port", str(control_port), "--recover", "--parent", str(os.getpid())]
        proc = _start_interpreter(argv, self.log_file, self.secret, append=True)
        log.warning(
            "restarted the supervisor (pid %d, was %d): it takes the job back from its journal", proc.pid, self.pid
        )
        self.pid, self._proc, self.returncode = proc.pid, proc, None
        self.restarts += 1

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
    host: str,
    port: int,
    world_size: int,
    timeout: float,
    host_store: bool,
    control_port: int | None = None,
    *,
    secret: bytes,
    launch_id: str,
    publish_secret: bool = False,
    wait: float | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> Supervisor:
    """Start the supervisor for a job of `world_size` ranks whose store is (to be) at `host:port`.

    It serves the control plane on `control_port` (see `resolve_control_port`; unset: a free port)
    to the ranks of launch `launch_id` that prove they hold `secret` (`lightning_prague.core.auth`),
    and publishes `secret` in the store if `publish_secret` (one rank 0 generated). `wait`: how long
    it waits for the first rank (the rendezvous' bound; default `timeout`). `log_dir`: where its log
    goes and stays (default: `LOG_DIR_VARIABLE`, else a temporary file deleted at a clean exit).
    """
    control_port = resolve_control_port(control_port)
    log_dir = _log_folder(log_dir)
    log_file = _new_log_file(log_dir, port)
    again = _restart_argv(
        host, port, world_size, timeout, host_store, launch_id, log_dir, log_file, wait, publish_secret
    )
    argv = [*again, "--control-port", str(control_port or 0), "--parent", str(os.getpid())]
    # (an initialised MPI library is no reason not to fork here: the supervisor ends with `os._exit`, so
    # MPI's finalisation, which hangs in a forked child, never runs in it)
    if hasattr(os, "fork") and not cuda_initialized():
        handle = _fork(argv, log_file, secret)
    else:
        proc = _start_interpreter(argv, log_file, secret)
        handle = Supervisor(proc.pid, log_file, proc)
    handle.argv, handle.secret, handle.journal = again, secret, journal_path(log_dir, port, launch_id)
    log.debug(
        "started the supervisor (pid %d) for %d ranks, store at %s:%d, control plane port %s",
        handle.pid,
        world_size,
        host,
        port,
        control_port or "free",
    )
    return handle


def adopt(
    pid: int,
    host: str,
    port: int,
    world_size: int,
    timeout: float,
    host_store: bool,
    *,
    secret: bytes,
    launch_id: str,
    wait: float,
    publish_secret: bool,
    log_dir: str | os.PathLike[str] | None = None,
) -> Supervisor:
    """A later process of global rank 0 (one that rejoined the running fit) takes on the handle of the
    supervisor `pid` that its first process started, so that it too starts it again if it dies
    (`Job`'s reconnect). The supervisor's journal is found where `launch` put it (the same `log_dir`
    and launch give the same path, `journal_path`); without it on this machine nothing is started
    again (`Supervisor.dead` stays False)."""
    log_dir = _log_folder(log_dir)
    journal = journal_path(log_dir, port, launch_id)
    handle = Supervisor(pid, journal.with_suffix(".log"), adopted=True)
    handle.argv = _restart_argv(
        host, port, world_size, timeout, host_store, launch_id, log_dir, handle.log_file, wait, publish_secret
    )
    handle.secret, handle.journal = secret, journal
    if journal_in_use(journal) is None:
        log.debug(
            "rank 0: no journal of the supervisor at %s here: a supervisor that dies is not started again", journal
        )
    return handle


def journal_path(log_dir: str | os.PathLike[str] | None, port: int, launch_id: str) -> Path:
    """Where the supervisor of launch `launch_id` at store port `port` journals (`log_dir`: the folder
    its log goes to, else the temporary folder): a name every process of global rank 0 derives alike."""
    digest = hashlib.sha256(launch_id.encode()).hexdigest()[:16]
    return (
        Path(log_dir if log_dir is not None else tempfile.gettempdir())
        / f"lightning_prague-plane-{port}-{digest}.journal"
    )


def _log_folder(log_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str] | None:
    """The folder the supervisor's log and journal go to (made), else `None`: the temporary folder."""
    log_dir = log_dir if log_dir is not None else (os.environ.get(LOG_DIR_VARIABLE) or None)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    return log_dir


def _new_log_file(log_dir: str | os.PathLike[str] | None, port: int) -> Path:
    """A file of our own, new for this launch, that nobody else can have made or read (mode 0600)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    fd, name = tempfile.mkstemp(
        prefix=f"lightning_prague-supervisor-{port}-" if log_dir is None else f"supervisor-{stamp}-{port}-",
        suffix=".log",
        dir=log_dir,
    )
    os.close(fd)
    return Path(name)


def _restart_argv(
    host: str,
    port: int,
    world_size: int,
    timeout: float,
    host_store: bool,
    launch_id: str,
    log_dir: str | os.PathLike[str] | None,
    log_file: Path,
    wait: float | None,
    publish_secret: bool,
) -> list[str]:
    """The supervisor's command line but its control port and its launcher (the same at every start)."""
    argv = ["--host", host, "--port", str(port), "--world-size", str(world_size), "--timeout", str(timeout)]
    argv += ["--log", str(log_file)] + (["--host-store"] if host_store else [])
    argv += ["--keep-log"] if log_dir is not None else []  # a folder of the user's: the log outlives the job
    argv += ["--launch", launch_id, "--wait", str(timeout if wait is None else wait)]
    argv += ["--publish-secret"] if publish_secret else []
    return argv + ["--journal", str(journal_path(log_dir, port, launch_id))]


def _start_interpreter(argv: list[str], log_file: Path, secret: bytes, append: bool = False) -> subprocess.Popen:
    """The supervisor in a fresh interpreter that imports only the core (see the module docstring)."""
    package = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env[SECRET_VARIABLE] = secret.decode()  # its environment, not its command line: `ps` shows that
    # (an adopted supervisor's log has a name others can know, in the temporary folder by default: never
    # through a symbolic link someone left there, and only ours to read)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    with os.fdopen(os.open(log_file, flags, 0o600), "w") as err:
        return subprocess.Popen(
            [sys.executable, "-c", BOOTSTRAP, package, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=env,
        )


def _fork(argv: list[str], log_file: Path, secret: bytes) -> Supervisor:
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
        os.environ[SECRET_VARIABLE] = secret.decode()
        with open(log_file, "w") as err, open(os.devnull, "rb+") as null:
            os.dup2(null.fileno(), 0)
            os.dup2(null.fileno(), 1)
            os.dup2(err.fileno(), 2)
        for handler in list(logging.root.handlers):  # the parent's handlers write where it does
            logging.root.removeHandler(handler)
        release_inherited_descriptors(keep=(0, 1, 2))  # before main opens its own (store, server)
        main(argv)
        status = 0
    except SystemExit as err:  # its reason, where rank 0 reads it (the log file is this process's stderr)
        print(f"supervisor: {err}", file=sys.stderr, flush=True)
        status = err.code if isinstance(err.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(status)


def release_inherited_descriptors(keep: tuple[int, ...] = (0, 1, 2)) -> int:
    """In a forked child: let go of every socket and file it inherited but `keep` (the standard
    streams: its log is its standard error); returns how many it let go of. Other descriptors (event,
    epoll and pipe descriptors of native libraries' process-wide state) are left alone.

    Each is pointed at /dev/null (`dup2`) rather than closed: the socket or file it held is released
    (a peer sees the connection close once the parent lets go of it too), but its number stays taken,
    so no descriptor the child opens later gets a number that an object inherited from the parent
    (a socket, a file) may still close when the garbage collector drops it."""
    own = _open_descriptors()
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    released = 0
    try:
        for fd in own:
            if fd in keep or fd == null:
                continue
            try:
                mode = os.fstat(fd).st_mode  # not the listing's own descriptor, closed by now
                # sockets and files only: an event or epoll descriptor (an anonymous inode) or a pipe may
                # belong to a native library's process-wide state (libuv's loop under torch's TCPStore),
                # which the supervisor's own store then uses; replacing it breaks that store
                if not (stat.S_ISSOCK(mode) or stat.S_ISREG(mode)):
                    continue
                os.dup2(null, fd, inheritable=False)
                released += 1
            except OSError:
                pass
    finally:
        os.close(null)
    return released


def _open_descriptors() -> list[int]:
    """This process's open file descriptors (Linux: /proc/self/fd; elsewhere every possible number)."""
    try:
        return sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = limit if 0 < limit < 1 << 16 else 1 << 16
        found = []
        for fd in range(limit):
            try:
                os.fstat(fd)
            except OSError:
                continue
            found.append(fd)
        return found


def wait_until_listening(proc: Supervisor, host: str, port: int, timeout: float) -> None:
    """Return once the supervisor's store accepts connections; raise if the supervisor ended first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise CoordinationTimeout(
                f"rank 0: the supervisor (the process that hosts the store and the control plane at {host}:{port}) "
                f"exited with status {proc.returncode} at start-up:\n{proc.output()}"
            )
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise CoordinationTimeout(
                    f"rank 0: the supervisor did not listen at {host}:{port} within {timeout:.0f}s"
                ) from None
            time.sleep(0.05)
