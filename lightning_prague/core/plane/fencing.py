"""Fencing a hung worker safely: kill a pid only once the kernel confirms that it is the job's worker.

The control plane fences a hung worker by sending it SIGKILL, so that a hang becomes a departure
like a crash. Which process to kill cannot be taken from the worker's own word: the pid it claims
in a message is only a claim, and a hostile or buggy message could name any process of the user
(or the control plane itself). This module asks the kernel instead (Linux only): the worker's TCP
connection to the control plane is the one thing the control plane knows for sure, so it looks up
that connection's client socket in `/proc/net/tcp` and `/proc/net/tcp6` and checks that the claimed
pid holds that socket among its open file descriptors (`/proc/<pid>/fd/`), and that the process
belongs to this user. Anything that cannot be verified (another OS, no `/proc`, another network
namespace, a process that is gone or not readable, malformed rows) counts as not verified: the
control plane then kills nothing, and the worker is merely dropped.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

#: the kernel's TCP socket tables of this process's network namespace, IPv4 and IPv6
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _normalize(ip: str) -> _Address:
    """`ip` parsed, without an IPv6 zone (`%eth0`, which /proc does not show), an IPv4-mapped IPv6
    address (`::ffff:127.0.0.1`) turned into its IPv4 form, so that both spellings compare equal."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _decode(field: str) -> tuple[_Address, int]:
    """An address of /proc/net/tcp{,6} (`0100007F:1F90`) as (ip, port).

    The kernel prints the address as 32-bit words in host byte order (4 words for IPv6), each
    holding the network-order bytes, so each word is turned back into bytes in the host's order;
    the port is a plain hex number."""
    hex_ip, hex_port = field.split(":")
    if len(hex_ip) not in (8, 32):
        raise ValueError(f"unexpected address {field!r}")
    raw = b"".join(int(hex_ip[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_ip), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(hex_port, 16)


def _socket_inodes(local: tuple[_Address, int], remote: tuple[_Address, int]) -> set[int]:
    """The inodes (nonzero) of the TCP sockets of this network namespace whose local address is
    `local` and remote address is `remote`. Unreadable tables and malformed rows are skipped."""
    inodes: set[int] = set()
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()[1:]  # the first line is the header
        except OSError:
            continue  # no IPv6 in this kernel, or no /proc
        for line in lines:
            fields = line.split()
            try:
                if _decode(fields[1]) != local or _decode(fields[2]) != remote:
                    continue
                inode = int(fields[9])
            except (IndexError, ValueError):
                continue
            if inode > 0:  # a socket in TIME_WAIT has none: no process holds it
                inodes.add(inode)
    return inodes


def owns_connection(pid: int, client: tuple[str, int], server: tuple[str, int]) -> bool:
    """Whether process `pid` holds the client end of the TCP connection `client` -> `server`.

    `client` is the connection's client side as the server sees it (`getpeername()[:2]` of the
    accepted socket), `server` the server's side (`getsockname()[:2]` of the accepted socket).
    Why: a pid named in a message may be any pid, so before the control plane kills the process
    that claims to be a worker, the kernel must confirm that this process really is at the other
    end of that worker's connection. The process must also belong to this user; pids <= 1 and
    this process itself are never accepted.

    Linux only, and the client must live in this process's network namespace (its socket is looked
    up in `/proc/net/tcp{,6}`). Never raises: whatever cannot be verified returns False.
    """
    try:
        return _owns_connection(pid, client, server)
    except Exception:  # never let a verification crash the control plane: unverified is not owned
        log.debug("fencing: pid %r not verified: the check failed", pid, exc_info=True)
        return False


def _owns_connection(pid: int, client: tuple[str, int], server: tuple[str, int]) -> bool:
    if not sys.platform.startswith("linux"):
        log.debug("fencing: pid %r not verified: not Linux (%s)", pid, sys.platform)
        return False
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        log.debug("fencing: pid %r not verified: not a pid that may be killed", pid)
        return False
    if pid == os.getpid():
        log.debug("fencing: pid %d not verified: it is this process", pid)
        return False
    try:
        local = (_normalize(client[0]), int(client[1]))
        remote = (_normalize(server[0]), int(server[1]))
    except (TypeError, ValueError, IndexError):
        log.debug("fencing: pid %d not verified: malformed addresses %r -> %r", pid, client, server)
        return False
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError as e:
        log.debug("fencing: pid %d not verified: no such process readable (%s)", pid, e)
        return False
    if owner != os.getuid():
        log.debug("fencing: pid %d not verified: it belongs to uid %d, not %d", pid, owner, os.getuid())
        return False
    inodes = _socket_inodes(local, remote)
    if not inodes:
        log.debug("fencing: pid %d not verified: no socket %s:%d -> %s:%d in this namespace", pid, *local, *remote)
        return False
    targets = {f"socket:[{inode}]" for inode in inodes}
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError as e:
        log.debug("fencing: pid %d not verified: its descriptors are not readable (%s)", pid, e)
        return False
    for fd in fds:
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link in targets:
            log.debug("fencing: pid %d verified: it holds %s (%s:%d -> %s:%d)", pid, link, *local, *remote)
            return True
    log.debug("fencing: pid %d not verified: it does not hold the socket %s:%d -> %s:%d", pid, *local, *remote)
    return False


def fence(pid: int, client: tuple[str, int], server: tuple[str, int]) -> bool:
    """SIGKILL process `pid` if, right now, it verifiably holds the client end of the connection
    `client` -> `server` (see `owns_connection`); True only if the signal was sent.

    Why verify here and not earlier: a pid is reused once its process is gone, so a verification
    made some time ago may name another process by now. Where Linux offers pidfds, the process is
    pinned by a pidfd before the check and signalled through it, so that not even the instant
    between the check and the kill lets a reused pid be hit (a process that died meanwhile is then
    simply not signalled). Never raises: an unverified pid or a failed kill returns False.
    """
    pidfd = _open_pidfd(pid)
    try:
        if not owns_connection(pid, client, server):
            log.debug("fencing: pid %r not killed: not verified", pid)
            return False
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except OSError as e:
            log.debug("fencing: pid %d not killed: %s", pid, e)
            return False
        log.debug("fencing: pid %d killed (SIGKILL)", pid)
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd pinning process `pid`, or None where pidfds are unavailable or `pid` is no valid pid
    (then `fence` falls back to `os.kill`, and `owns_connection` rejects what must be rejected)."""
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # gone (owns_connection will say so), or pidfds blocked: fall back to os.kill
        return None


def running_cpu_seconds(pid: int, client: tuple[str, int], server: tuple[str, int]) -> float | None:
    """The CPU seconds process `pid` has used, if it verifiably holds the connection `client` ->
    `server` (`owns_connection`) and is running (not stopped, traced or a zombie); else `None`.

    The hang detector asks this of a silent rank on its own host: a process that keeps using the
    CPU without a word holds the interpreter in one long call (it computes), a stopped one is frozen.
    """
    if not owns_connection(pid, client, server):
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        state, utime, stime = fields[0], int(fields[11]), int(fields[12])
    except (OSError, IndexError, ValueError):
        return None
    if state in (b"T", b"t", b"Z", b"X"):
        return None
    return (utime + stime) / os.sysconf("SC_CLK_TCK")
