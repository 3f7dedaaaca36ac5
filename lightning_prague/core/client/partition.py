"""A node cut off from the others (a network partition, a node powered off): both sides of it.

A partition closes no connection: packets are lost, and every TCP connection across it waits on
retransmissions (for up to about 15 minutes by the kernel's default). The control plane sees the
cut node's ranks go silent and declares them hung by the rule of `lightning_prague.core.plane.liveness`;
the rest follows from two measures:

* **the cut side fences itself**: every beat of a worker is answered by the control plane, and a
  worker that has heard nothing from it for its own hang bound plus `MARGIN_SECONDS` ends its
  process with an error that says so (`lightning_prague.core.client.control.Session.check_reachable`),
  as a fenced worker does when the control plane can tell it. It never trains on beside the
  survivors (a split brain), and never waits forever.
* **the survivors drop their connections to a lost node**: once every rank of a node other than
  the control plane's has departed, the control plane names the node's addresses in the departure
  notice and every survivor shuts down its own TCP connections to them (`drop_connections`). An
  exchange that was waiting on a rank of that node (a gloo send or receive, which cannot be polled
  or aborted) then fails at once on that pair only, as it does when a peer's process dies, instead
  of waiting for the operation's timeout; a gloo timeout would close every connection of the
  process that hit it, failing its exchanges with other survivors too.

The node that holds the control plane always goes on (with its ranks, and any others that can still
reach it); whichever side cannot reach the control plane stops.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterable, Iterator

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.records import environment_number

log = logging.getLogger(__name__)

#: seconds a worker waits beyond its hang bound before it fences itself (the control plane declares
#: it lost at its bound; the worker ends a little later, so it never ends before it is counted out)
MARGIN_SECONDS = 2.0
#: exit status of a process that ends itself because it is cut off from the control plane (EX_TEMPFAIL):
#: it cannot tell whether the job goes on, so it does not report success
FENCED_EXIT_STATUS = 75
#: environment variable: the exit status of a rank the control plane excluded from a job that goes on
#: (declared hung and told so); default `EXCLUDED_EXIT_DEFAULT`
EXCLUDED_EXIT_VARIABLE = "LIGHTNING_PRAGUE_EXCLUDED_EXIT_STATUS"
#: 0: the job goes on without the rank, and a launcher that sees any other status ends or marks the
#: whole job failed (torchrun stops every worker, SLURM's `KillOnBadExit` kills the step, `afterok` fails)
EXCLUDED_EXIT_DEFAULT = 0


def excluded_exit_status() -> int:
    """The exit status of a rank the control plane excluded (`EXCLUDED_EXIT_VARIABLE`, 0-255)."""
    try:  # (a process that is ending: a bad value costs a log line, not the exit)
        status = environment_number(EXCLUDED_EXIT_VARIABLE, int, 0, 255, "an exit status (0-255)")
    except ConfigurationError as err:
        log.error("%s: using %d", err, FENCED_EXIT_STATUS)
        return FENCED_EXIT_STATUS
    return EXCLUDED_EXIT_DEFAULT if status is None else status


_SIOCGIFADDR = 0x8915
#: environment variables naming the interfaces the backends use between nodes
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux), or `None`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def own_addresses(local: str | None = None) -> list[str]:
    """The addresses other nodes reach this process at: `local` (where its connection to the control
    plane leaves from) and those of the interfaces named to gloo and NCCL (`GLOO_SOCKET_IFNAME`, ...).
    Loopback addresses are left out: they are every node's own."""
    found = [] if local is None else [local]
    for variable in _INTERFACE_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value.startswith("^"):  # NCCL's syntax for interfaces to avoid: names none to use
            continue
        for name in value.split(","):
            address = interface_address(name.strip().lstrip("=")) if name.strip() else None
            if address is not None:
                found.append(address)
    return sorted({_plain(a) for a in found if not _loopback(a)})


def _plain(address: str) -> str:
    """An IPv4-mapped IPv6 address as IPv4 (``::ffff:10.0.0.2`` -> ``10.0.0.2``)."""
    parsed = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def _loopback(address: str) -> bool:
    try:
        parsed = ipaddress.ip_address(_plain(address))
    except ValueError:
        return True
    return parsed.is_loopback or parsed.is_unspecified


def _socket_inodes() -> dict[int, int]:
    """Socket inode -> one of this process's file descriptors for it."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.setdefault(int(target[8:-1]), int(entry))
    return found


def _decode(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (hex, per 32-bit word in host order)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(struct.pack("=I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, len(raw), 4))
    return _plain(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words))


def connections_to(addresses: Iterable[str]) -> list[tuple[int, str, int]]:
    """This process's TCP connections to any of `addresses`: (file descriptor, remote address, port)."""
    wanted = {_plain(a) for a in addresses if not _loopback(a)}
    if not wanted:
        return []
    inodes = _socket_inodes()
    found = []
    for fields in _tcp_rows():
        remote, inode = fields[2], int(fields[9])
        address_hex, port_hex = remote.rsplit(":", 1)
        fd = inodes.get(inode)
        if fd is None or inode == 0:
            continue
        address = _decode(address_hex)
        if address in wanted:
            found.append((fd, address, int(port_hex, 16)))
    return found


def _tcp_rows() -> Iterator[list[str]]:
    """The rows of this network namespace's TCP tables (IPv4 and IPv6), split into fields; an
    unreadable table (no IPv6, no /proc) and a short row are skipped."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) >= 10:
                yield fields


def drop_connections(addresses: Iterable[str], rank: int, why: str) -> int:
    """Shut down this process's TCP connections to `addresses` (a lost node's); how many.

    The sockets stay open (their owners, such as gloo's pairs, see the connection end and close them);
    only this process's side of each connection ends, at once, whatever the network does.
    """
    dropped = 0
    for fd, address, port in connections_to(addresses):
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            dropped += 1
        except OSError as err:
            log.debug("rank %d: could not shut down the connection to %s:%d: %s", rank, address, port, err)
    if dropped:
        log.warning(
            "rank %d: dropped its %d connection(s) to %s (%s), so that no exchange waits on them",
            rank,
            dropped,
            ", ".join(sorted({_plain(a) for a in addresses})),
            why,
        )
    return dropped


#: `/proc/net/tcp`'s state of an established connection (a listening socket is `0A`)
_ESTABLISHED = "01"


def established_connections() -> dict[int, int]:
    """This process's established TCP connections (no listening socket): socket inode -> one of its
    file descriptors. Compared before and after a step that connects, it names that step's connections."""
    inodes = _socket_inodes()
    found: dict[int, int] = {}
    for fields in _tcp_rows():
        if fields[3] == _ESTABLISHED and int(fields[9]) in inodes:
            found[int(fields[9])] = inodes[int(fields[9])]
    return found


def shut_down_connections(inodes: Iterable[int], rank: int, why: str) -> int:
    """Shut down this process's side of the established connections `inodes` (those still open); how
    many. As in `drop_connections`, the sockets stay open and their owners see the connection end:
    a gloo operation of the peer with this process on one of them fails at once, as if this process
    had ended. Never a listening socket: gloo's listener thread ends the process if its socket fails."""
    wanted = set(inodes)
    dropped = 0
    for inode, fd in established_connections().items():
        if inode not in wanted:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            dropped += 1
        except OSError as err:
            log.debug("rank %d: could not shut down connection %d: %s", rank, inode, err)
    if dropped:
        log.warning("rank %d: shut down %d connection(s) (%s), so that no peer waits on them", rank, dropped, why)
    return dropped
