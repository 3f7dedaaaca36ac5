"""The supervisor: a process of its own that hosts the job's control plane (and usually its store).

Global rank 0 starts it at set-up (`plane.launch.launch`), before the process group exists, so no training
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

How it is started is `lightning_prague.core.plane.launch`'s; this module is what runs in it.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from datetime import timedelta

from lightning_prague.core.protocol import PORT_VARIABLE, address_key

log = logging.getLogger(__name__)


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

    from lightning_prague.core.plane.coordinator import ControlPlane
    from lightning_prague.core.plane.server import MessageServer

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
