"""The control plane's journal: a plane started again after it died takes the running job back.

The control plane (`ControlPlane`) is deterministic: what it holds (sessions, groups issued,
meetings, the work queue and its ledger, verdicts, membership epochs, gossip rounds) follows from
the sequence of what it handled. `JournaledPlane` sits between the server and the plane and
writes that sequence to a file before anything it produced leaves the process:

* every message of a rank (beats excepted: they feed only the hang detector, which a new plane
  starts afresh), with the rank's number for it (`MESSAGE_SEQ`);
* every connection that opened afresh (a new process for a rank) and every one that closed;
* every finding of the hang detectors (which depends on the clock, so the finding is what is
  written, with whether the rank was sent `fenced`), and every sweep that deleted a session;
* every renewal of a membership epoch after a restart (`took_back`: the groups of an admission's
  epoch met in the store that died with the plane).

Every item the plane sends a rank is numbered (`ITEM_SEQ`, consecutive per rank), and the last
`RESEND_ITEMS` items of each rank are kept. A plane started with the journal (`recover`) replays it
into a fresh `ControlPlane`, without sending or fencing anything, and so stands where the dead one
stood, numbers included. Each rank's link (`lightning_prague.core.client.link`) then reconnects
with the number of the last item it got; the plane answers which of the rank's messages it has
handled (`RESUMED`) and sends the items the rank missed; the link sends the messages the plane never
handled again. So no message is lost or handled twice across the restart, and every rank goes on
from the same state as the others:

* a claim of the work queue, a `ready`, a meeting's `arrive`, a verdict or a gossip round's question
  that was in flight is answered by the new plane, as the old one would have; so is a replica
  follower's claim that `follow`s its leader's answers: they are numbered and kept as the claims are
  replayed (`FollowedClaims`), so the new plane holds the same answers and waiting follows;
* a group sum in flight keeps its all-or-nothing verdict: the verdict table is part of the state;
* a rank that does not come back within its silent bound is declared lost, as a silent rank is.

Limits, each refused by name rather than guessed: a journal of another launch; a rank that got more
items than the journal explains (the file lost its end, e.g. with the machine's page cache: the
journal is flushed to the operating system at every entry, not synced to disk); a rank that missed
more than `RESEND_ITEMS` items; a connection that closed while this plane ran (that rank is lost).

Everything read from the file is untrusted input: every line is a typed record, and every message in
it is checked by the same rules as a message from a socket (`decode_message`). A last line cut short
(the plane died while writing it) is ignored; any other bad line refuses the recovery. Between fits
(no session open) the file is compacted to what the numbering needs.

One plane at a time: a plane holds its journal's lock (`hold_journal`, a `flock` on a file next to it)
for as long as it lives. A second plane on the same journal is refused, and whoever would start a
dead plane again (`lightning_prague.core.plane.launch`) tells a dead one from a live one by whether
the lock is free (`journal_in_use`), on any process of the machine, whoever started it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_prague.core.errors import ControlPlaneError
from lightning_prague.core.protocol import (
    ALIVE,
    ITEM_SEQ,
    MESSAGE_SEQ,
    RESUMED,
    BadMessage,
    Message,
    check_message,
    encode_line,
)
from lightning_prague.core.records import BOOLEAN, BadRecord, Record, integer, json_object, list_of, one_of, text

if TYPE_CHECKING:
    from lightning_prague.core.plane.coordinator import ControlPlane

log = logging.getLogger(__name__)

#: items kept per rank for a link that resumes (what it may have missed when the plane died)
RESEND_ITEMS = 1024
#: items per rank kept in a compacted journal (between fits)
BASE_ITEMS = 64
#: entries after which a journal with no session open is compacted
COMPACT_AFTER = 10_000
JOURNAL_VERSION = 1

Out = dict[int, list[Message]]

_RANK = integer(0, (1 << 31) - 1)
_HEADER = Record("the journal's header", {"k": one_of("journal"), "v": integer(1, 1), "launch": text(256)})
_ENTRIES = {
    "msg": Record("a message entry", {"k": one_of("msg"), "msg": json_object(256)}),
    "connect": Record("a connect entry", {"k": one_of("connect"), "rank": _RANK}),
    "disconnect": Record("a disconnect entry", {"k": one_of("disconnect"), "rank": _RANK}),
    "hang": Record(
        "a hang entry",
        {
            "k": one_of("hang"),
            "s": _RANK,
            "rank": _RANK,
            "kind": one_of("left_out", "hung"),
            "reason": text(4096),
            "fenced": BOOLEAN,
        },
    ),
    "sweep": Record("a sweep entry", {"k": one_of("sweep")}),
    "renew": Record("a renew entry", {"k": one_of("renew")}),
    "base": Record(
        "a base entry",
        {
            "k": one_of("base"),
            "next": json_object(1 << 20),
            "handled": json_object(1 << 20),
            "known": list_of(_RANK, 1 << 20),
            "gone": list_of(_RANK, 1 << 20),
            "ring": json_object(1 << 20),
        },
    ),
}


class JournalError(ControlPlaneError):
    """The journal cannot be replayed (another launch's, or a line that is not an entry)."""


#: the journals this process holds the lock of (path -> the lock file's descriptor, open for its life)
_HELD: dict[Path, int] = {}


def lock_path(journal: Path) -> Path:
    """The file whose lock says a plane uses `journal` (the journal itself is replaced when compacted)."""
    return journal.with_name(journal.name + ".lock")


def hold_journal(journal: Path) -> None:
    """Take `journal`'s lock for the life of this process (see the module docstring); `JournalError`
    naming the holder if another plane holds it. Again in the same process: nothing to do."""
    journal = Path(journal)
    if journal in _HELD:
        return
    path = lock_path(journal)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise JournalError(
            f"another control plane (pid {holder or '?'}) uses the journal {journal}: one plane at a time serves a "
            "job; stop that one first"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[journal] = fd
    log.debug("holding the journal %s", journal)


def journal_in_use(journal: Path) -> bool | None:
    """Whether a live process holds `journal`'s lock: `None` where there is no lock file here (no plane
    journaled there on this machine, or it stopped cleanly), else True or False."""
    journal = Path(journal)
    if journal in _HELD:
        return True
    try:
        fd = os.open(lock_path(journal), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (releases a lock it took)
    return False


def release_journal(journal: Path, delete: bool = False) -> None:
    """Let go of `journal`'s lock (a plane that stopped); `delete`: remove the lock file too (the journal
    was deleted: nothing to take back)."""
    journal = Path(journal)
    fd = _HELD.pop(journal, None)
    if delete:
        lock_path(journal).unlink(missing_ok=True)
    if fd is not None:
        os.close(fd)


class Journal:
    """The append-only file (see the module docstring); `None`-safe to leave out (no recovery)."""

    def __init__(self, path: Path, launch: str) -> None:
        self.path = Path(path)
        self.launch = launch
        self.entries = 0
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self._file = os.fdopen(fd, "ab")
        if fresh:
            self._write({"k": "journal", "v": JOURNAL_VERSION, "launch": launch})
            self.flush()

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write(encode_line(entry))

    def flush(self) -> None:
        """Into the operating system: the server calls it before it sends what the entries produced
        (`MessageServer`'s `before_send`), so nothing leaves the process that the file does not explain."""
        self._file.flush()

    def append(self, entry: dict[str, Any]) -> None:
        self._write(entry)
        self.entries += 1

    def rewrite(self, base: dict[str, Any]) -> None:
        """Replace the file by its header and `base` (atomically: a crash leaves the old file or the new)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(encode_line({"k": "journal", "v": JOURNAL_VERSION, "launch": self.launch}))
            f.write(encode_line(base))
        self._file.close()  # (what it held is in the base)
        os.replace(tmp, self.path)
        self._file = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND), "ab")
        self.entries = 0

    def close(self) -> None:
        self._file.close()


def read_journal(path: Path, launch: str | None) -> tuple[str, list[dict[str, Any]]]:
    """`(its launch, its entries)`, each checked (see the module docstring); `JournalError` names what is
    wrong. `launch`: the launch it must be of (`None`: any, the service takes the journal's)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise JournalError(f"cannot read the control plane's journal {path}: {err}") from None
    lines = data.split(b"\n")
    cut_short = lines.pop()  # after the last newline: empty, or a line the dead plane did not finish
    if cut_short:
        log.warning("journal %s: its last line was cut short (the plane died writing it): ignored", path)
    if not lines:
        raise JournalError(f"the control plane's journal {path} is empty")
    header = _entry(path, 1, lines[0], {"journal": _HEADER})
    if launch is not None and header["launch"] != launch:
        raise JournalError(
            f"the control plane's journal {path} is of launch {header['launch']!r}, not {launch!r}: another job's"
        )
    return header["launch"], [_entry(path, number, line, _ENTRIES) for number, line in enumerate(lines[1:], 2)]


def _entry(path: Path, number: int, line: bytes, records: dict[str, Record]) -> dict[str, Any]:
    try:
        entry = json.loads(line)
        record = records.get(entry.get("k")) if isinstance(entry, dict) else None
        if record is None:
            raise BadRecord(f"not an entry: {line[:80]!r}")
        record.check(entry)
        if entry["k"] == "msg":  # the same rules as a message from a socket
            entry["msg"] = check_message(entry["msg"])
        if entry["k"] == "base":
            _check_base(entry)
    except (ValueError, RecursionError, BadRecord, BadMessage) as err:
        raise JournalError(f"the control plane's journal {path}, line {number}: {err}") from None
    return entry


def _check_base(entry: dict[str, Any]) -> None:
    for field in ("next", "handled"):
        for key, value in entry[field].items():
            if not key.isdigit() or not _RANK(value):
                raise BadRecord(f"base {field!r}: {key!r}: {value!r} is not a rank's count")
    for key, items in entry["ring"].items():
        if not key.isdigit() or not isinstance(items, list) or len(items) > RESEND_ITEMS:
            raise BadRecord(f"base 'ring': {key!r} is not a rank's list of items")
        if not all(isinstance(item, dict) and _RANK(item.get(ITEM_SEQ)) for item in items):
            raise BadRecord(f"base 'ring': rank {key}'s items are not numbered items")


class JournaledPlane:
    """The server's handler, `on_connect`, `on_disconnect` and `on_tick`: a `ControlPlane` whose inputs
    are journaled and whose items are numbered (see the module docstring)."""

    def __init__(self, plane: ControlPlane, journal: Journal | None = None) -> None:
        self.plane = plane
        self.journal = journal
        #: rank -> the number of the last item issued to it
        self.issued: dict[int, int] = {}
        #: rank -> the number of the last message of it handled (since its process connected)
        self.handled: dict[int, int] = {}
        #: rank -> its last items, numbered, for a link that resumes
        self.ring: dict[int, deque[Message]] = {}
        #: ranks that ever connected, and those whose connection closed since (lost to this plane)
        self.known: set[int] = set()
        self.gone: set[int] = set()
        self._replaying = False

    @property
    def ends(self):  # the server's `ends`, for fencing: set on the plane itself
        return self.plane.ends

    @ends.setter
    def ends(self, value) -> None:
        self.plane.ends = value

    # -- the server's hooks ---------------------------------------------------------------------------
    def handle(self, message: Message) -> Out:
        rank = message["rank"]
        seq = message.pop(MESSAGE_SEQ, None)
        if seq is not None and seq <= self.handled.get(rank, 0):
            log.debug("journal: rank %d's message %d was handled before: dropped", rank, seq)
            return {}
        beat = message["op"] == "beat"  # the hang detector's alone: neither journaled nor numbered
        if not beat:  # written before it is handled (the plane may keep parts of it)
            self._record({"k": "msg", "msg": message if seq is None else {**message, MESSAGE_SEQ: seq}})
        if seq is not None:
            self.handled[rank] = seq
        out = self.plane.handle(message)
        return out if beat else self._number(out)

    def on_connect(self, rank: int, hello: Message | None = None) -> Out:
        if hello is not None and "got" in hello:
            return self._resume(rank, int(hello["got"]))
        self._record({"k": "connect", "rank": rank})
        self.known.add(rank)
        self.gone.discard(rank)
        self.handled[rank] = 0  # a new process numbers its messages from 1
        return self._number(self.plane.on_connect(rank))

    def on_disconnect(self, rank: int) -> Out:
        self._record({"k": "disconnect", "rank": rank})
        self.gone.add(rank)
        return self._number(self.plane.on_disconnect(rank))

    def tick(self) -> Out:
        out: Out = {}
        for number, rank, kind, reason in self.plane.hang_events():
            fenced = self.plane.apply_hang(number, rank, kind, reason, out)
            entry = {"k": "hang", "s": number, "rank": rank, "kind": kind, "reason": reason[:4000], "fenced": fenced}
            self._record(entry)
        if self.plane.sweep(out):
            self._record({"k": "sweep"})
        return self._number(out)

    def flush(self) -> None:
        """The server's `before_send`: the journal's entries of this pass reach the operating system first."""
        if self.journal is not None:
            self.journal.flush()

    # -- resuming a rank's link -----------------------------------------------------------------------
    def _resume(self, rank: int, got: int) -> Out:
        """A rank's link reconnected: which of its messages were handled, and the items after `got`."""
        issued = self.issued.get(rank, 0)
        ring = self.ring.get(rank, deque())
        if rank not in self.known:
            error = "this control plane has no record of it (was it started again without its journal?)"
        elif rank in self.gone:
            error = "its connection closed while this control plane ran, and it was declared lost"
        elif got > issued:
            error = (
                f"it got item {got}, but this control plane issued {issued}: its journal lacks what the last one did "
                "(a journal on another machine, or cut short with the machine)"
            )
        elif got < issued and (not ring or ring[0][ITEM_SEQ] > got + 1):
            error = f"it missed items {got + 1}-{issued}, more than the {RESEND_ITEMS} kept per rank"
        else:
            missed = [item for item in ring if item[ITEM_SEQ] > got]
            log.warning("rank %d resumed its link: %d items sent again", rank, len(missed))
            return {rank: [{"t": RESUMED, "handled": self.handled.get(rank, 0)}, *missed]}
        log.error("rank %d cannot resume its link: %s", rank, error)
        return {rank: [{"t": RESUMED, "error": f"rank {rank} cannot resume its link to the control plane: {error}"}]}

    def _number(self, out: Out) -> Out:
        numbered: Out = {}
        for rank, items in out.items():
            ring = self.ring.get(rank)
            if ring is None:
                ring = self.ring[rank] = deque(maxlen=RESEND_ITEMS)
            count = self.issued.get(rank, 0)
            marked = []
            for item in items:
                if item.get("t") == ALIVE:
                    marked.append(item)
                    continue
                count += 1
                item = {**item, ITEM_SEQ: count}
                ring.append(item)
                marked.append(item)
            self.issued[rank] = count
            numbered[rank] = marked
        return numbered

    # -- the journal ---------------------------------------------------------------------------------
    def _record(self, entry: dict[str, Any]) -> None:
        if self.journal is None or self._replaying:
            return
        if self.journal.entries >= COMPACT_AFTER and not self.plane.sessions:  # (the state before `entry`)
            self.journal.rewrite(self._base())
            log.debug("journal: compacted (no session open)")
        self.journal.append(entry)

    def _base(self) -> dict[str, Any]:
        return {
            "k": "base",
            "next": {str(r): n for r, n in self.issued.items()},
            "handled": {str(r): m for r, m in self.handled.items()},
            "known": sorted(self.known),
            "gone": sorted(self.gone),
            "ring": {str(r): list(ring)[-BASE_ITEMS:] for r, ring in self.ring.items() if ring},
        }

    def replay(self, entries: list[dict[str, Any]]) -> None:
        """Stand where the plane that wrote `entries` stood (nothing is sent, nobody is fenced)."""
        self._replaying = True
        try:
            for entry in entries:
                self._apply(entry)
        finally:
            self._replaying = False
        log.warning(
            "journal: replayed %d entries: %d sessions open, ranks %s connected when the last plane stopped",
            len(entries),
            len(self.plane.sessions),
            sorted(self.known - self.gone),
        )

    def _apply(self, entry: dict[str, Any]) -> None:
        kind = entry["k"]
        if kind == "msg":
            self.handle(dict(entry["msg"]))
        elif kind == "connect":
            self.on_connect(entry["rank"])
        elif kind == "disconnect":
            self.on_disconnect(entry["rank"])
        elif kind == "hang":
            out: Out = {}
            self.plane.apply_hang(entry["s"], entry["rank"], entry["kind"], entry["reason"], out, entry["fenced"])
            self._number(out)
        elif kind == "sweep":
            out = {}
            self.plane.sweep(out)
            self._number(out)
        elif kind == "renew":
            out = {}
            self.plane.renew_epochs(out)
            self._number(out)
        elif kind == "base":
            if self.plane.sessions:
                raise JournalError("a base entry while sessions are open: the journal is not this package's")
            self.issued = {int(r): n for r, n in entry["next"].items()}
            self.handled = {int(r): m for r, m in entry["handled"].items()}
            self.known, self.gone = set(entry["known"]), set(entry["gone"])
            self.ring = {int(r): deque(items, maxlen=RESEND_ITEMS) for r, items in entry["ring"].items()}

    def took_back(self) -> None:
        """After `replay`, once the journal is open again: membership epochs whose groups met in the
        store that died with the old plane are renewed (`ControlPlane.renew_epochs`)."""
        out: Out = {}
        if self.plane.renew_epochs(out):
            self._record({"k": "renew"})
            self._number(out)  # in the members' rings: each gets them when its link resumes

    def connected_when_stopped(self) -> Iterator[int]:
        """The ranks whose connections were open when the journal ends (they come back: `_resume`)."""
        return iter(sorted(self.known - self.gone))
