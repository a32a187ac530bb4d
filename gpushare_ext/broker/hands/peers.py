"""Who is at the other end of a client connection, and how much it may ask.

Identity comes from the kernel, never from a message: uid, gid and pid from
``SO_PEERCRED``, the user's name and groups from the host's user database, the
process's start time from ``/proc`` (so a lease outlives neither its process nor a
reused pid).  A client's own claim (``Hello.pid``) is checked against the kernel's,
across PID namespaces (a notebook pod sees its own numbers).  The per-user token bucket
limits how fast one user may send.

Nothing here reads or writes the socket's data, and nothing decides policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import socket
import struct
import time
from dataclasses import dataclass

from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import Hello

_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def user_and_groups(uid: int, gid: int) -> tuple[str, tuple[str, ...]]:
    try:
        entry = pwd.getpwuid(uid)
        name = entry.pw_name
        gids = os.getgrouplist(name, gid)
    except KeyError:
        return f"uid{uid}", ()
    names = []
    for g in gids:
        with contextlib.suppress(KeyError):
            names.append(grp.getgrgid(g).gr_name)
    return name, tuple(names)


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/stat`` from its third field on (the state), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            raw = stat_file.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rfind(b")") + 2 :].split()


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if it is gone or unreadable."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None  # field 22 of stat(5)
    except (IndexError, ValueError):
        return None


def process_ended(pid: int, start_ticks: int | None = None) -> bool:
    """Whether the process a session or lease belongs to is gone: no such pid, another
    process that got the pid since (``start_ticks`` differ), or a zombie.  A zombie is
    dead but not yet reaped by its parent; a child it forked may still hold its
    connection open, so its end would otherwise wait for that child, or for ever under a
    parent that never reaps (a container's first process that is no init)."""
    fields = _stat_fields(pid)
    if fields is None:
        try:  # no /proc to read: only whether the pid exists at all
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    if fields[:1] in ([b"Z"], [b"X"]):  # zombie, or dead and being reaped
        return True
    if start_ticks is None:
        return False
    try:
        return int(fields[19]) != start_ticks
    except (IndexError, ValueError):
        return False


def pid_as_seen_by_itself(pid: int) -> int | None:
    """The number ``pid`` has in its own PID namespace (``NSpid``), None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return pid  # kernels before 4.1 have no NSpid line: one namespace


def _status_fields(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as status:
            return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)
    except OSError:
        return {}


def descends_from(pid: int, ancestor: int, uid: int) -> bool:
    """Whether ``pid`` is a live descendant of ``ancestor`` owned by ``uid`` (its real
    uid), as ``/proc`` tells: only a notebook's own worker processes may run its ranks."""
    fields = _status_fields(pid)
    try:
        if int(fields.get("Uid", "").split()[0]) != uid:
            return False
    except (IndexError, ValueError):
        return False
    seen = 0
    while pid > 1 and seen < 64:  # a parent chain is short; a loop is no chain
        try:
            pid = int(_status_fields(pid).get("PPid", "0"))
        except ValueError:
            return False
        if pid == ancestor:
            return True
        seen += 1
    return False


def descendant_named(claimed: int, ancestor: int, uid: int) -> int | None:
    """The pid, as this process sees it, of the descendant of ``ancestor`` (owned by
    ``uid``) that a client names ``claimed``; None if there is none.

    A client names its processes as it sees them.  In a container with a PID namespace
    of its own that number is not the broker's, so the descendants are looked up by the
    number each has in its own namespace (``NSpid``) too."""
    if descends_from(claimed, ancestor, uid) and pid_as_seen_by_itself(claimed) == claimed:
        return claimed
    found = None
    for entry in os.listdir("/proc"):
        if not entry.isdecimal():
            continue
        pid = int(entry)
        if pid_as_seen_by_itself(pid) == claimed and descends_from(pid, ancestor, uid):
            if found is not None:
                return None  # two candidates: naming it is ambiguous, so refuse
            found = pid
    return found


def claimed_pid_matches(peer_pid: int, claimed: int) -> bool:
    """Whether a client that says it is ``claimed`` is the process the kernel names."""
    return claimed == peer_pid or claimed == pid_as_seen_by_itself(peer_pid)


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclass(eq=False, kw_only=True)
class Connection:
    """One client connection and what the broker knows of its peer."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pid: int
    uid: int
    gid: int
    user: str
    groups: tuple[str, ...]
    is_admin: bool
    start_ticks: int | None = None
    session_id: str | None = None
    hello: Hello | None = None
    control_block: ControlBlock | None = None
    watch_task: asyncio.Task | None = None
    closed: bool = False
