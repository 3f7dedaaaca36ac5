"""The supervisor: a process of its own that hosts the job's control plane (and usually its store).

Global rank 0 starts it at set-up (`plane.launch.launch`), before the process group exists, so no training
process hosts anything the others need: any worker, rank 0 included, may die and the survivors
still reach the store and the coordinator, which tells them who is gone. It

* hosts the job's TCPStore at `MASTER_ADDR:MASTER_PORT` (every training rank is a client, as under
  torchrun's agent), unless a store is already there (torchrun's agent store, or a process group
  that was initialised before): then it is a client of that store;
* serves the control plane (`ControlPlane` behind a `MessageServer`) on MASTER_ADDR's interface
  (or the one `CONTROL_HOST_VARIABLE` names), on a free port or a fixed one for firewalls (the
  strategies' `coordinator_port`, given to `launch` as `control_port`, or the
  `LIGHTNING_PRAGUE_CONTROL_PORT` environment variable), to connections that prove they hold the
  launch's key (`lightning_prague.core.auth`; the secret comes in its environment, never on its
  command line), and publishes its address, pid and launch (and a generated secret) in the store
  (`ADDRESS_RECORD` under `address_key()`): every rank can reach that host, since the store is there;
* exits by itself once every rank of the job has connected and all of them have closed their
  connections (the job ended, or every worker is gone); or, with no rank connected, when the
  process that launched it is gone or `--wait` seconds passed (the process group's rendezvous
  bound: ranks connect only after it). It runs in a session of its own (a signal for rank 0's
  process group does not reach it) and needs nothing but torch and the core of this package (it
  never imports Lightning).

How it is started is `lightning_prague.core.plane.launch`'s; this module is what runs in it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_prague.core.auth import SECRET_VARIABLE, Credentials
from lightning_prague.core.protocol import PORT_VARIABLE, address_key

#: environment variable: the address the control plane listens on (an address of this node, or
#: `0.0.0.0` / `::` for every interface); default: MASTER_ADDR's
CONTROL_HOST_VARIABLE = "LIGHTNING_PRAGUE_CONTROL_HOST"

if TYPE_CHECKING:
    from lightning_prague.core.plane.server import MessageServer

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="lightning-prague's supervisor (started by global rank 0)")
    parser.add_argument("--host", required=True, help="MASTER_ADDR: where the ranks reach this node")
    parser.add_argument("--port", type=int, required=True, help="MASTER_PORT: the store's port")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=300.0, help="the store's operation timeout")
    parser.add_argument("--wait", type=float, default=1800.0, help="seconds to wait for the first rank")
    parser.add_argument("--parent", type=int, default=0, help="the launching process: gone, and no rank, exit")
    parser.add_argument("--launch", required=True, help="the launch's id (lightning_prague.core.auth)")
    parser.add_argument("--publish-secret", action="store_true", help="publish the secret (generated) in the store")
    parser.add_argument("--host-store", action="store_true", help="host the TCPStore (else: be a client)")
    parser.add_argument(
        "--control-port", type=int, help=f"the control plane's port (0: a free one; unset: {PORT_VARIABLE} or 0)"
    )
    parser.add_argument("--log", help="this process's log file, deleted at a clean exit unless --keep-log")
    parser.add_argument("--keep-log", action="store_true", help="keep the log file (a folder the user chose)")
    parser.add_argument("--journal", help="the control plane's journal (lightning_prague.core.plane.journal)")
    parser.add_argument("--recover", action="store_true", help="take the running job back from --journal")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("LIGHTNING_PRAGUE_SUPERVISOR_LOG", "WARNING"),
        format=f"supervisor[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    import torch.distributed as dist

    from lightning_prague.core.plane.journal import release_journal
    from lightning_prague.core.plane.server import raise_descriptor_limit

    descriptors = raise_descriptor_limit()  # a flood of connections meets this limit first
    log.debug("descriptor limit %d", descriptors)

    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore(
        args.host, args.port, args.world_size, is_master=args.host_store, timeout=timeout, wait_for_workers=False
    )
    secret = os.environ.pop(SECRET_VARIABLE, "")
    if not secret:
        raise SystemExit(f"the supervisor needs the job's secret in {SECRET_VARIABLE}")
    credentials = Credentials.derive(secret.encode(), args.launch)
    port = args.control_port if args.control_port is not None else int(os.environ.get(PORT_VARIABLE, "0"))
    listen, published = listen_address(args.host)
    journal = Path(args.journal) if args.journal else None
    plane = dict(journal=journal, recover=args.recover)
    try:
        server = serve_plane(listen, port, credentials, **plane)
    except OSError as err:
        if os.environ.get(CONTROL_HOST_VARIABLE):
            raise SystemExit(f"{CONTROL_HOST_VARIABLE}={listen}: cannot listen there ({err})") from None
        log.warning(
            "MASTER_ADDR %s (%s) is not an address of this node (%s): the control plane listens on every interface; "
            "set %s to this node's address that the ranks reach to narrow it",
            args.host,
            listen,
            err,
            CONTROL_HOST_VARIABLE,
        )
        server = serve_plane("", port, credentials, **plane)
    record = {"host": published, "port": server.address[1], "pid": os.getpid(), "launch": args.launch}
    record["store"] = args.host_store
    if args.publish_secret:
        record["secret"] = secret
    store.set(address_key(), json.dumps(record))
    log.info(
        "serving %d ranks: store %s:%d, control plane %s:%d (launch %s)",
        args.world_size,
        args.host,
        args.port,
        server.address[0],
        server.address[1],
        args.launch,
    )
    started = time.monotonic()
    while server.alive:
        time.sleep(0.05)
        if server.connected:
            continue
        if args.recover and not server.hellos and time.monotonic() - started < args.wait:
            continue  # the ranks of the job it took back have yet to reconnect
        everyone_came = len(server.ever_connected) >= args.world_size
        launcher_gone = args.parent > 0 and os.getppid() != args.parent
        if everyone_came or launcher_gone or time.monotonic() - started > args.wait:
            break
    server.close()
    log.info("exiting: %d of %d ranks came and all are gone", len(server.ever_connected), args.world_size)
    if server.error is None:  # the job is over: nothing to take back (its log stays in a folder of the user's)
        if journal is not None:
            release_journal(journal, delete=True)
        for path in (args.journal, None if args.keep_log else args.log):
            try:
                os.unlink(path) if path else None
            except OSError:
                pass
    os._exit(0 if server.error is None else 1)  # the store's threads must not hold the exit


def serve_plane(
    host: str, port: int, credentials: Credentials, journal: Path | None = None, recover: bool = False
) -> MessageServer:
    """The control plane (`ControlPlane`) served on `host:port` (0: a free port), started; `OSError`
    if it cannot listen there. The supervisor's and the plane service's (`lightning_prague.core.plane.service`).

    `journal`: the file it journals what it handles to (`lightning_prague.core.plane.journal`); with
    `recover`, it first takes back the job that file describes (a `JournalError` if it cannot)."""
    from lightning_prague.core.plane.coordinator import ControlPlane
    from lightning_prague.core.plane.journal import Journal, JournaledPlane, hold_journal, read_journal
    from lightning_prague.core.plane.server import MessageServer

    if journal is not None:
        hold_journal(journal)  # one plane at a time; a dead one's lock is free
    plane = JournaledPlane(ControlPlane())
    if recover and journal is not None and journal.exists():
        _, entries = read_journal(journal, credentials.launch)
        plane.replay(entries)
    if journal is not None:
        plane.journal = Journal(journal, credentials.launch)
    if recover:
        plane.took_back()
    server = MessageServer(
        plane.handle,
        host,
        credentials,
        name="prague-control-plane",
        port=port,
        on_connect=plane.on_connect,
        on_disconnect=plane.on_disconnect,
        on_tick=plane.tick,
        before_send=plane.flush,
    )
    server.ever_connected |= plane.known  # the ranks it took back: items for them wait in the journal's ring
    plane.ends = server.ends
    server.start()
    return server


def listen_address(master_addr: str) -> tuple[str, str]:
    """`(the address to listen on, the address to publish)`: `CONTROL_HOST_VARIABLE`'s if set, else
    MASTER_ADDR's (where every rank reaches this node). A host name that resolves to a loopback
    address here (`127.0.1.1` in /etc/hosts) is reached by other nodes at another address: every
    interface then, as PyTorch's store listens."""
    chosen = os.environ.get(CONTROL_HOST_VARIABLE, "").strip()
    if chosen:
        wildcard = chosen in ("0.0.0.0", "::", "*")
        return ("" if wildcard else chosen), (master_addr if wildcard else chosen)
    try:
        resolved = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0]
        loopback = ipaddress.ip_address(str(resolved).split("%")[0]).is_loopback
    except (OSError, ValueError, IndexError):
        return master_addr, master_addr  # listening fails, and says so
    if loopback and master_addr not in ("localhost", "127.0.0.1", "::1") and not _is_ip(master_addr):
        return "", master_addr
    return master_addr, master_addr


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
