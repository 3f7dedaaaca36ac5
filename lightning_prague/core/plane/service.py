"""The control plane as a service of its own: `lightning-prague plane`, on a host the user chooses.

By default global rank 0 starts the job's supervisor on its own node (`lightning_prague.core.plane.launch`):
the job's store and its control plane then live and die with that node, the one process of the job
whose loss ends the fit. On a spot or preemptible cloud, run them here instead, on a small
on-demand CPU node or a pod of its own (as torchft runs its lighthouse), one service per job:

    export LIGHTNING_PRAGUE_SECRET_FILE=/shared/prague-secret    # the job's secret, here and on every rank
    lightning-prague plane --port 29400 --log-dir /shared/plane-logs

and give every rank its address (`LIGHTNING_PRAGUE_PLANE=planehost:29400`, or the strategies'
`plane` option). The service hosts the job's store (a TCPStore at `--port`: the ranks' process
group meets there, and so do regroups and rejoins) and the control plane (at `--control-port`),
and publishes the plane's address in the store as the supervisor does. Every rank, rank 0
included, is then a client of both: rank 0 starts no supervisor, and its node can be lost like any
other (its duties, the checkpoint writer and the logger, move to the lowest live rank).

Unlike the supervisor, the service never publishes the secret: it needs one of the user's
(`LIGHTNING_PRAGUE_SECRET` or `LIGHTNING_PRAGUE_SECRET_FILE`), and every rank must have the same.
It runs until it is stopped (SIGTERM or SIGINT), and serves one job: the launch it serves is its
own (`--launch`, default a fresh one), which the ranks take from its record, since the user named
the service explicitly.

With `--log-dir`, it journals what it handles there (`JOURNAL_NAME`, `lightning_prague.core.plane.journal`).
If it dies (`kill -9`, its node restarted with the folder on a shared file system), start it again with
the same command: it finds the journal, takes the running job back (its launch, its fits, every
rank's place in them) and every rank reconnects within its wait (`LIGHTNING_PRAGUE_PLANE_WAIT`, 60 s by
default). A clean stop deletes the journal; `--fresh` sets an old one aside and serves a new job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_prague.core.auth import SECRET_FILE_VARIABLE, SECRET_VARIABLE, Credentials, new_launch_id, user_secret
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.plane.journal import JournalError, hold_journal, release_journal
from lightning_prague.core.protocol import SERVICE_ADDRESS_KEY

if TYPE_CHECKING:
    from lightning_prague.core.plane.server import MessageServer

log = logging.getLogger(__name__)

#: environment variable: the plane service's address, `HOST:PORT` (its store's port), on every rank
PLANE_VARIABLE = "LIGHTNING_PRAGUE_PLANE"
#: `--host` values that listen on every interface
WILDCARDS = ("0.0.0.0", "::", "*", "")
#: the service's default ports: its store, and its control plane
STORE_PORT, CONTROL_PORT = 29400, 29401
#: the plane's journal in `--log-dir`
JOURNAL_NAME = "plane-journal.jsonl"


def plane_address(option: str | None = None) -> tuple[str, int] | None:
    """The plane service's `(host, store port)`: `option` (the strategies' `plane`), else
    `PLANE_VARIABLE`'s, else `None` (global rank 0 starts the job's supervisor, the default).
    `ConfigurationError` for an address that is not `HOST:PORT`, or both set to different ones."""
    variable = os.environ.get(PLANE_VARIABLE, "").strip()
    if option and variable and option.strip() != variable:
        raise ConfigurationError(
            f"plane={option!r} and {PLANE_VARIABLE}={variable!r} name different plane services: set only one of them"
        )
    text = (option or variable or "").strip()
    if not text:
        return None
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        source = f"plane={option!r}" if option else f"{PLANE_VARIABLE}={variable!r}"
        raise ConfigurationError(f"{source}: the plane service's address must be HOST:PORT (e.g. planehost:29400)")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    """`lightning-prague plane`: serve one job's store and control plane until stopped."""
    parser = argparse.ArgumentParser(
        prog="lightning-prague plane",
        description="Serve a job's store and control plane on this host (see docs/fault_tolerance.md, The control "
        f"plane as a service). The job's secret comes from {SECRET_VARIABLE} or {SECRET_FILE_VARIABLE}.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: every interface)")
    parser.add_argument(
        "--advertise",
        help="the address the ranks reach this host at, published in the store (default: --host, or this host's "
        "name when --host listens on every interface)",
    )
    parser.add_argument("--port", type=int, default=STORE_PORT, help=f"the store's port (default {STORE_PORT})")
    parser.add_argument(
        "--control-port", type=int, default=CONTROL_PORT, help=f"the control plane's port (default {CONTROL_PORT})"
    )
    parser.add_argument("--log-dir", type=Path, help="write the service's log to plane.log there (default: stderr)")
    parser.add_argument("--launch", help="the launch id it serves (default: a fresh one)")
    parser.add_argument("--log-level", default="INFO", help="the log's level (DEBUG traces every message)")
    parser.add_argument(
        "--fresh", action="store_true", help="serve a new job even if --log-dir holds the journal of a running one"
    )
    args = parser.parse_args(argv)
    secret = user_secret()
    if secret is None:
        raise SystemExit(
            f"lightning-prague plane: set the job's secret in {SECRET_VARIABLE} or {SECRET_FILE_VARIABLE} (the same "
            "on every rank): a plane service never hands out a secret of its own"
        )
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(args.log_dir / "plane.log"))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s plane %(levelname)s %(name)s: %(message)s", handlers=handlers
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    journal = None if args.log_dir is None else args.log_dir / JOURNAL_NAME
    if journal is not None:
        try:  # before anything reads or sets aside the journal: another service may use it
            hold_journal(journal)
        except JournalError as err:
            raise SystemExit(f"lightning-prague plane: {err}") from None
    recover = journal is not None and journal.exists() and journal.stat().st_size > 0
    if recover and args.fresh:
        assert journal is not None
        journal.replace(journal.with_name(f"{JOURNAL_NAME}.{int(time.time())}.old"))
        recover = False
    server, address, store = serve(
        args.host, args.advertise, args.port, args.control_port, secret, args.launch, journal, recover
    )
    print(
        f"lightning-prague plane: serving the job's store at {address}:{args.port} and its control plane at "
        f"{address}:{server.address[1]} (pid {os.getpid()}); on every rank: {PLANE_VARIABLE}={address}:{args.port}",
        flush=True,
    )
    while not stop.wait(0.5) and server.alive:
        pass
    failed = server.error
    server.close()
    del store  # served until here
    if failed is None and journal is not None:  # stopped cleanly: nothing to take back
        journal.unlink(missing_ok=True)
        release_journal(journal, delete=True)
    log.info("stopped%s", f" after an error: {failed}" if failed else "")
    os._exit(0 if failed is None else 1)  # the store's threads must not hold the exit


def serve(
    host: str,
    advertise: str | None,
    port: int,
    control_port: int,
    secret: bytes,
    launch: str | None,
    journal: Path | None = None,
    recover: bool = False,
) -> tuple[MessageServer, str, Any]:
    """Host the store at `host:port` and the control plane at `host:control_port`, and publish the
    plane's record in the store; returns `(the plane's server, the address published, the store)`:
    the store serves as long as its object lives. `journal`: the plane's journal; `recover`: take the
    job it describes back (its launch; `--launch`, if given, must be the same)."""
    import torch.distributed as dist

    from lightning_prague.core.plane.journal import read_journal
    from lightning_prague.core.plane.server import raise_descriptor_limit
    from lightning_prague.core.plane.supervisor import serve_plane

    raise_descriptor_limit()
    if recover and journal is not None:
        journaled, _ = read_journal(journal, launch)
        log.warning("taking back launch %s from the journal %s", journaled, journal)
        launch = journaled
    launch = launch or new_launch_id()
    wildcard = host in WILDCARDS
    store = dist.TCPStore(
        "0.0.0.0" if host in ("", "*") else host, port, 1, is_master=True, timeout=timedelta(seconds=300),
        wait_for_workers=False,
    )  # fmt: skip
    credentials = Credentials.derive(secret, launch)
    server = serve_plane("" if wildcard else host, control_port, credentials, journal=journal, recover=recover)
    published = advertise or (socket.gethostname() if wildcard else host)
    record = {"host": published, "port": server.address[1], "pid": os.getpid(), "launch": launch, "store": True}
    store.set(SERVICE_ADDRESS_KEY, json.dumps(record))
    log.info("store %s:%d, control plane %s:%d, launch %s", published, port, published, server.address[1], launch)
    return server, published, store


if __name__ == "__main__":
    main()
