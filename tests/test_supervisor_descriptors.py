"""The forked supervisor keeps none of the descriptors of the process that started it (rank 0's):
not its sockets (gloo's, the store's), not its files."""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest
from helpers import LAUNCH, free_port

from lightning_prague.core.plane.launch import launch, release_inherited_descriptors, wait_until_listening

pytestmark = pytest.mark.timeout(60)


def descriptors(pid: int) -> dict[int, str]:
    """fd -> what it points at (`socket:[inode]`, a path), of process `pid`."""
    found = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            pass
    return found


def test_the_forked_supervisor_inherits_no_socket_and_no_file_of_rank_0():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    held = tempfile.NamedTemporaryFile(prefix="rank0-file-")
    ours = {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in (listener, client, accepted)}
    try:
        port = free_port()
        supervisor = launch("127.0.0.1", port, 2, timeout=5.0, host_store=True, wait=3.0, **LAUNCH)
        wait_until_listening(supervisor, "127.0.0.1", port, timeout=30)  # it works: listens, logs
        held_by_it = descriptors(supervisor.pid)
        assert not ours & set(held_by_it.values()), held_by_it
        assert held.name not in held_by_it.values(), held_by_it
        assert held_by_it[2] == str(supervisor.log_file)  # its log: its standard error
        deadline = time.monotonic() + 30
        while supervisor.poll() is None and time.monotonic() < deadline:  # nobody came: it ends after 3 s
            time.sleep(0.05)
        assert supervisor.poll() == 0
    finally:
        for s in (listener, client, accepted):
            s.close()
        held.close()


def test_release_points_inherited_sockets_and_files_at_dev_null_and_leaves_pipes_alone(tmp_path):
    # a pipe or an event descriptor may be a native library's process-wide state (libuv under torch's
    # store): the supervisor's own store would break without it
    left, right = socket.socketpair()
    handle = open(tmp_path / "inherited.txt", "w")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what the supervisor does first
        try:
            released = release_inherited_descriptors(keep=(0, 1, 2))
            gone = all(os.readlink(f"/proc/self/fd/{fd}") == os.devnull for fd in (left.fileno(), handle.fileno()))
            kept = all(os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:") for fd in (read, write))
            os._exit(0 if released >= 3 and gone and kept else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    for fd in (read, write):
        os.close(fd)
    left.close()
    right.close()
    handle.close()
    assert os.waitstatus_to_exitcode(status) == 0
