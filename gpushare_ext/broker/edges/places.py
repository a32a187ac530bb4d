"""The broker's places in the file system: its socket and the directory of control blocks.

Made safely, or refused with one line (:class:`PlaceError`):

* the socket's directory is created (0755 for a system broker, 0700 for a user's) when
  missing, and otherwise trusted only if the broker's own user or root owns it and
  nobody else can write it (a sticky ``/tmp`` is accepted: others cannot replace the
  socket there).  It is never ``chmod``-ed: ``/tmp`` stays as it was;
* a socket left by a dead broker is removed, a live one means another broker serves
  there, and anything that is not a socket is refused;
* control blocks live in a directory nobody else can list: the system broker's fixed
  ``/run/gpushare/sessions`` (0711, so users reach their own 0600 blocks), or a fresh
  directory with an unguessable name under ``/dev/shm``, so no one can prepare it.
  Directories a dead predecessor on the same socket left there are removed.

It must not import the server: the server calls it at startup and shutdown.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
from pathlib import Path

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.paths import SHM_DIR, BrokerPaths
from gpushare_ext.safe_fs import (
    UnsafePathError,
    fresh_private_directory,
    remove_own_directory,
    remove_own_files,
    trusted_directory,
)


class PlaceError(DaemonError, RuntimeError):
    """A place the broker cannot use safely; the message is one line naming it."""


def prepare_socket_directory(paths: BrokerPaths) -> Path:
    mode = 0o755 if paths.mode == "system" else 0o700
    try:
        return trusted_directory(
            paths.socket.parent,
            trusted={os.geteuid()},
            create_mode=mode,
            allow_sticky=True,
            hint="the broker's socket must be in a directory only it (or root) can write",
        )
    except UnsafePathError as exc:
        raise PlaceError(str(exc)) from None


def clear_socket_path(path: Path) -> None:
    """Remove a dead broker's socket; refuse anything else that is there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise PlaceError(f"{path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left over by a dead broker
    else:
        raise PlaceError(f"another broker already serves {path}")
    finally:
        probe.close()


#: Connections the kernel queues for the broker before it accepts them: a hub's every
#: kernel and panel reconnect at once after a restart.  The server passes it again to
#: asyncio, whose own default (100) would otherwise replace it when it listens anew.
LISTEN_BACKLOG = 1024


def bind_socket(paths: BrokerPaths, socket_group: str | None) -> socket.socket:
    """The listening socket, with its mode set before anyone can connect."""
    clear_socket_path(paths.socket)
    system = paths.mode == "system"
    mode = 0o666 if system else 0o600
    gid = -1
    if system and socket_group:
        try:
            gid = grp.getgrnam(socket_group).gr_gid
        except KeyError:
            raise PlaceError(f"socket_group {socket_group!r} is not a group on this host") from None
        mode = 0o660
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # born with its final mode: no window at 0777
    try:
        listener.bind(str(paths.socket))
    except OSError as exc:
        listener.close()
        raise PlaceError(f"cannot listen on {paths.socket}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    # The directory is trusted (only we and root write it), so the name is still ours.
    os.chmod(paths.socket, mode)
    if gid != -1:
        os.chown(paths.socket, 0, gid)
    # A hub's kernels reconnect all at once after a restart: 100 (the default) is short.
    listener.listen(LISTEN_BACKLOG)
    listener.setblocking(False)
    return listener


def prepare_sessions_directory(paths: BrokerPaths) -> Path:
    """Where this run's control blocks go; stale blocks and directories are removed."""
    system = paths.mode == "system"
    if paths.sessions_dir is not None:
        mode = 0o711 if system else 0o700
        try:
            directory = trusted_directory(
                paths.sessions_dir, trusted={os.geteuid()}, create_mode=mode
            )
        except UnsafePathError as exc:
            raise PlaceError(str(exc)) from None
        info = os.lstat(directory)
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o066:
            raise PlaceError(
                f"{directory} must be the broker's own and not listable by others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}; chmod {mode:o} {directory})"
            )
        remove_own_files(directory, ("*.cb",))
        return directory
    remove_stale_sessions(paths)
    mode = 0o711 if system else 0o700
    for parent in (SHM_DIR, paths.socket.parent):
        with contextlib.suppress(UnsafePathError, OSError):
            return fresh_private_directory(parent, paths.sessions_prefix, mode)
    raise PlaceError(
        f"no place for control blocks: neither {SHM_DIR} nor {paths.socket.parent} is usable"
    )


def remove_stale_sessions(paths: BrokerPaths) -> None:
    """Directories of a dead broker on the same socket (ours only; links are left alone)."""
    legacy = paths.sessions_prefix.rstrip("-")  # the fixed name of earlier versions
    for parent in (SHM_DIR, paths.socket.parent):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if name.startswith(paths.sessions_prefix) or name == legacy:
                remove_own_directory(parent / name, ("*.cb",))


def remove_sessions_directory(paths: BrokerPaths, directory: Path) -> None:
    """At shutdown: the fixed directory is emptied, a fresh one removed."""
    if paths.sessions_dir is not None:
        remove_own_files(directory, ("*.cb",))
    else:
        remove_own_directory(directory, ("*.cb",))
