"""Where the broker's socket, control blocks, journal and config live, in both modes.

System mode (a root broker shared by every user of the host):
``/run/gpushare/broker.sock``, control blocks in ``/run/gpushare/sessions``,
``/etc/gpushare/broker.toml``, ``/var/lib/gpushare/journal.sqlite``.  User mode (the
embedded per-user broker): a 0700 directory ``$XDG_RUNTIME_DIR/gpushare`` (or
``/tmp/gpushare-<uid>``) holding the socket, control blocks in a fresh 0700 directory
with an unguessable name under ``/dev/shm``, and
``$XDG_STATE_HOME/gpushare/journal.sqlite``.  ``GPUSHARE_SOCKET`` overrides the socket a
client connects to; ``GPUSHARE_BROKER_USER`` names the account a system broker runs as
when it is not root.

This module only names places; :mod:`gpushare_ext.safe_fs` checks and makes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
from dataclasses import dataclass
from pathlib import Path

SYSTEM_RUNTIME_DIR = Path("/run/gpushare")
SYSTEM_SOCKET = SYSTEM_RUNTIME_DIR / "broker.sock"
SYSTEM_CONFIG = Path("/etc/gpushare/broker.toml")
SYSTEM_JOURNAL = Path("/var/lib/gpushare/journal.sqlite")


SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class BrokerPaths:
    mode: str  # "system" or "user"
    runtime_dir: Path
    socket: Path
    # A fixed sessions directory (the system broker's, shared with pods by hostPath), or
    # None: a fresh one named ``sessions_prefix`` + random under /dev/shm at each start.
    sessions_dir: Path | None
    sessions_prefix: str
    journal: Path
    config: Path | None


def user_runtime_dir(uid: int | None = None) -> Path:
    uid = os.getuid() if uid is None else uid
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and uid == os.getuid() and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "gpushare"
    return Path(f"/tmp/gpushare-{uid}")


def user_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "gpushare"


def sessions_prefix_for(socket: Path) -> str:
    """Name prefix of this broker's sessions directories under /dev/shm: one per socket,
    so a restarted broker finds (and removes) the directories of its dead predecessor."""
    tag = hashlib.sha256(str(socket).encode()).hexdigest()[:10]
    return f"gpushare-{os.geteuid()}-{tag}-"


def sessions_dir_for(mode: str, socket: Path) -> Path | None:
    """Where control blocks live: always on tmpfs, because the GPU can only pin shared
    memory pages (``cuMemHostRegister`` refuses pages of files on disk).  None: a fresh
    directory under /dev/shm (``SHM_DIR``) whose name nobody can guess in advance."""
    if mode == "system" and socket == SYSTEM_SOCKET:
        return SYSTEM_RUNTIME_DIR / "sessions"  # /run is tmpfs; shared with pods by hostPath
    return None


def broker_paths(mode: str, socket: str | Path | None = None) -> BrokerPaths:
    if mode == "system":
        runtime = SYSTEM_RUNTIME_DIR if socket is None else Path(socket).parent
        socket_path = Path(socket) if socket else SYSTEM_SOCKET
        return BrokerPaths(
            mode="system",
            runtime_dir=runtime,
            socket=socket_path,
            sessions_dir=sessions_dir_for("system", socket_path),
            sessions_prefix=sessions_prefix_for(socket_path),
            journal=SYSTEM_JOURNAL,
            config=SYSTEM_CONFIG,
        )
    runtime = user_runtime_dir() if socket is None else Path(socket).parent
    socket_path = Path(socket) if socket else runtime / "broker.sock"
    return BrokerPaths(
        mode="user",
        runtime_dir=runtime,
        socket=socket_path,
        sessions_dir=sessions_dir_for("user", socket_path),
        sessions_prefix=sessions_prefix_for(socket_path),
        journal=user_state_dir() / "journal.sqlite",
        config=None,
    )


def system_socket() -> Path:
    """Where clients look for the host's system broker: ``$GPUSHARE_SYSTEM_SOCKET``, else
    ``/run/gpushare/broker.sock``.  A host that mounts the broker's folder elsewhere (a
    pod) names it here; the test suite points it at a private path, so that its kernels
    never meet the host's own broker."""
    override = os.environ.get("GPUSHARE_SYSTEM_SOCKET")
    return Path(override) if override else SYSTEM_SOCKET


def default_socket_path() -> Path:
    """The socket a client should use: $GPUSHARE_SOCKET, else the system broker's if it
    exists, else this user's embedded broker's (which may not be running yet)."""
    override = os.environ.get("GPUSHARE_SOCKET")
    if override:
        return Path(override)
    system = system_socket()
    try:
        present = system.exists()
    except OSError:  # a folder this user may not look into: no broker for this user there
        present = False
    if present:
        return system
    return user_runtime_dir() / "broker.sock"


def trusted_broker_uids() -> frozenset[int]:
    """Who may run the broker a client talks to: root, this user (its embedded broker),
    and the account named by ``GPUSHARE_BROKER_USER`` (a system broker not run as root)."""
    uids = {0, os.getuid()}
    service = os.environ.get("GPUSHARE_BROKER_USER", "").strip()
    if service:
        if service.isdecimal():
            uids.add(int(service))
        else:
            # An unknown name adds nobody; the error then names the real owner.
            with contextlib.suppress(KeyError):
                uids.add(pwd.getpwnam(service).pw_uid)
    return frozenset(uids)


def how_a_broker_starts(socket_path: Path) -> str:
    """What brings a broker to ``socket_path``, in a sentence for a user who found none:
    the admin for the system socket; the user's own first ``%%gpu`` cell otherwise
    (single-user mode starts the embedded broker on demand)."""
    if Path(socket_path) in (SYSTEM_SOCKET, system_socket()):
        return "The admin starts the system broker (ask yours)"
    return "The first `%%gpu` cell of a notebook starts one for you (or run `gpushare broker`)"
