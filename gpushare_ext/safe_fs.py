"""Directories, sockets and files that no other user can swap or read: make them, or trust them.

A broker and its sessions meet in the file system (a socket, control blocks, a journal),
often under ``/tmp`` or ``/dev/shm`` where every user may create names.  So nothing here
takes a path on trust:

* a directory is *trusted* when every directory on its way from ``/`` is owned by root
  or a trusted user and cannot be written by anyone else (a sticky directory such as
  ``/tmp`` may be passed through, because others cannot rename or delete what is ours
  in it), and a symbolic link on the way is followed only if root or a trusted user
  owns it;
* a directory that is missing is created with its exact mode, one level at a time, and
  one that is already there is never ``chmod``-ed: if it is not owned right or is open
  to others, the caller gets a :class:`UnsafePathError` whose one-line message names
  the path, its owner and what to do;
* files are opened with ``O_NOFOLLOW`` and checked through their descriptor;
* a file that a privileged process takes orders from (the broker's config) is read by
  :func:`read_trusted_file` only if the walk to it is trusted as above and the file
  itself is a regular file of a trusted owner, closed to others' writes and size-capped.

Both sides use it: the broker before it creates its socket, sessions directory and
journal; the notebook runtime and the CLI before they connect to a broker.  This
module does no networking and decides no policy: callers say whom they trust.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import pwd
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from gpushare_ext.errors import GpushareError
from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text

_MAX_SYMLINKS = 40


class UnsafePathError(GpushareError):
    """A path that another user could control; the message is one line for the user."""


class PathMissing(UnsafePathError):
    """A directory on the way does not exist (and was not to be created)."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def describe_owner(uid: int) -> str:
    name = user_name(uid)
    return name if name.startswith("uid ") else f"{name} (uid {uid})"


def describe_trusted(uids: Iterable[int]) -> str:
    me = os.geteuid()
    names = []
    for uid in sorted(set(uids)):
        if uid == me and uid != 0:
            names.append("you")
        elif uid == 0:
            names.append("root")
        else:
            names.append(user_name(uid))
    return " or ".join(names)


def _check_directory(
    path: str, info: os.stat_result, trusted: frozenset[int], *, final: bool, allow_sticky: bool
) -> None:
    if info.st_uid not in trusted:
        raise UnsafePathError(
            f"{path} belongs to {describe_owner(info.st_uid)}, not to {describe_trusted(trusted)}"
        )
    others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky = info.st_mode & stat.S_ISVTX
    if others_write and not (sticky and (allow_sticky or not final)):
        raise UnsafePathError(
            f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):04o})"
        )


def trusted_directory(
    path: str | Path,
    *,
    trusted: Iterable[int],
    create_mode: int | None = None,
    allow_sticky: bool = False,
    private: bool = False,
    hint: str = "",
) -> Path:
    """Walk to ``path`` checking every step; create what is missing when ``create_mode`` is set.

    ``trusted`` are the uids that may own the directory itself and the directories and
    links on the way (root is always trusted).  ``allow_sticky`` accepts a sticky,
    world-writable final directory (a socket straight in ``/tmp``); ``private`` demands
    that the final directory grants nothing to group and others.  Returns the resolved
    path; raises :class:`UnsafePathError`.
    """
    trusted_uids = frozenset(trusted) | {0}
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise UnsafePathError(f"{text} is not an absolute path")
    suffix = f": {hint}" if hint else ""
    try:
        current = _walk(
            text,
            trusted_uids,
            create_mode=create_mode,
            allow_sticky=allow_sticky,
            private=private,
        )
    except UnsafePathError as exc:
        raise type(exc)(f"{exc}{suffix}") from None
    except OSError as exc:
        raise UnsafePathError(f"cannot use {text}: {exc.strerror}{suffix}") from None
    return Path(current)


def _components(text: str) -> list[str]:
    """The names of a path in order, without empty ones and ``.``."""
    return [part for part in text.split("/") if part and part != "."]


def _walk(
    text: str,
    trusted_uids: frozenset[int],
    *,
    create_mode: int | None,
    allow_sticky: bool,
    private: bool,
) -> str:
    """The checked walk of :func:`trusted_directory`, one component at a time from ``/``;
    returns the directory reached. Raises :class:`UnsafePathError` or ``OSError``."""
    pending = _components(text)
    pending.reverse()  # a stack: the next component is last
    current = "/"
    followed = 0
    _check_directory("/", os.lstat("/"), trusted_uids, final=not pending, allow_sticky=False)
    while pending:
        part = pending.pop()
        if part == "..":
            current = os.path.dirname(current) or "/"
            continue
        candidate = os.path.join(current, part)
        final = not pending
        info = _lstat_or_create(candidate, create_mode)
        if stat.S_ISLNK(info.st_mode):
            followed = _count_trusted_link(candidate, info, trusted_uids, followed, text)
            target = os.readlink(candidate)
            if os.path.isabs(target):
                current = "/"
            pending.extend(reversed(_components(target)))
            continue
        _check_step(
            candidate,
            info,
            trusted_uids,
            final=final,
            allow_sticky=allow_sticky,
            private=private,
        )
        current = candidate
    return current


def _lstat_or_create(candidate: str, create_mode: int | None) -> os.stat_result:
    """What is at ``candidate`` (not followed); a missing directory is made when
    ``create_mode`` is set, else :class:`PathMissing`."""
    try:
        return os.lstat(candidate)
    except FileNotFoundError:
        if create_mode is None:
            raise PathMissing(f"{candidate} does not exist") from None
        return _make_directory(candidate, create_mode)


def _count_trusted_link(
    candidate: str, info: os.stat_result, trusted_uids: frozenset[int], followed: int, text: str
) -> int:
    """Refuse a link that no trusted user owns, or one too many on the way; returns the
    number of links followed with this one."""
    if info.st_uid not in trusted_uids:
        raise UnsafePathError(
            f"{candidate} is a symbolic link owned by {describe_owner(info.st_uid)}: "
            "refusing to follow it"
        )
    followed += 1
    if followed > _MAX_SYMLINKS:
        raise UnsafePathError(f"{text} has too many levels of symbolic links")
    return followed


def _check_step(
    candidate: str,
    info: os.stat_result,
    trusted_uids: frozenset[int],
    *,
    final: bool,
    allow_sticky: bool,
    private: bool,
) -> None:
    """A directory on the way (not a link): a directory, trusted, closed to others'
    writes, and private when it is the last one and ``private`` is asked."""
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{candidate} is not a directory")
    _check_directory(candidate, info, trusted_uids, final=final, allow_sticky=allow_sticky)
    if final and private and stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafePathError(
            f"{candidate} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"it must be private (chmod 700 {candidate})"
        )


def _make_directory(path: str, mode: int) -> os.stat_result:
    """mkdir one level with exactly ``mode``; a name that appeared meanwhile is checked instead."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return os.lstat(path)  # somebody was faster: the caller checks what is there
    # mkdir obeys the umask; set the mode we asked for on what we just made, through
    # a descriptor so that nothing swapped in between is touched.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
        return os.fstat(fd)
    finally:
        os.close(fd)


def fresh_private_directory(parent: str | Path, prefix: str, mode: int = 0o700) -> Path:
    """A new directory with an unguessable name under a trusted ``parent`` (like mkdtemp).

    Nobody can have prepared it, so nothing in it is anyone else's.
    """
    parent_path = trusted_directory(parent, trusted={os.geteuid()}, allow_sticky=True)
    made = Path(tempfile.mkdtemp(prefix=prefix, dir=parent_path))
    fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return made


def remove_own_files(path: str | Path, patterns: tuple[str, ...] = ("*",)) -> bool:
    """Unlink the plain files (and sockets) matching ``patterns`` in a directory of ours.

    Returns False (and touches nothing) if ``path`` is a link, not a directory, or
    another user's.  Names are unlinked relative to the opened directory, so a name
    swapped for a link elsewhere cannot redirect the deletion.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        for name in os.listdir(fd):
            if not any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                continue
            with contextlib.suppress(OSError):
                info = os.lstat(name, dir_fd=fd)
                if stat.S_ISREG(info.st_mode) or stat.S_ISSOCK(info.st_mode):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    return True


def remove_own_directory(path: str | Path, patterns: tuple[str, ...] = ("*",)) -> bool:
    """Delete a directory of ours after its files matching ``patterns``; False if not ours."""
    if not remove_own_files(path, patterns):
        return False
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def check_socket(path: str | Path, *, trusted: Iterable[int], hint: str = "") -> Path:
    """The resolved path of a broker socket whose directory and file trusted users own.

    A socket straight in a sticky directory (``/tmp``) is accepted: others cannot
    replace it there.  Raises :class:`UnsafePathError`; ``FileNotFoundError`` when
    nothing is there (no broker yet).
    """
    path = Path(path)
    trusted_uids = frozenset(trusted) | {0}
    directory = trusted_directory(path.parent, trusted=trusted_uids, allow_sticky=True, hint=hint)
    resolved = directory / path.name
    try:
        info = os.lstat(resolved)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnsafePathError(f"cannot use {path}: {exc.strerror}") from None
    suffix = f": {hint}" if hint else ""
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafePathError(f"{path} is not a socket{suffix}")
    if info.st_uid not in trusted_uids:
        raise UnsafePathError(
            f"{path} belongs to {describe_owner(info.st_uid)}, not to "
            f"{describe_trusted(trusted_uids)}{suffix}"
        )
    return resolved


def open_private_file(path: str | Path, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """Open (or create) a file of ours, never through a link; tighten our own file to ``mode``.

    Raises :class:`UnsafePathError` if it is not a regular file or not ours.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link: refusing to follow it") from None
        raise UnsafePathError(f"cannot open {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} belongs to {describe_owner(info.st_uid)}, not to you")
        if stat.S_IMODE(info.st_mode) & ~mode:
            os.fchmod(fd, mode)  # ours, opened without following links: safe to tighten
    except BaseException:
        os.close(fd)
        raise
    return fd


def _shown_path(path: str) -> str:
    # A path a user may have named (a link's target) is shown as text, never as control
    # codes; the limit is generous: a path is the admin's to read in full.
    return plain_text(path, limit=4 * SENTENCE_LIMIT)


def read_trusted_file(
    path: str | Path, *, trusted: Iterable[int], max_bytes: int, what: str = "file"
) -> bytes:
    """The bytes of a file that only trusted users can have written, read at most ``max_bytes``.

    For a file that a privileged process takes orders from (the broker's config): the
    file and every directory on the way to it must belong to root or a ``trusted`` uid
    and be closed to writes by group and others (a sticky directory such as ``/tmp`` may
    be passed through), a symbolic link on the way or at the end is followed only if a
    trusted user owns it (and its target passes the same walk), and the file must be a
    regular file of at most ``max_bytes``.  A FIFO or device is refused without waiting
    on it.  Raises :class:`UnsafePathError` whose one line starts with ``what`` and the
    path, then says why.
    """
    trusted_uids = frozenset(trusted) | {0}
    given = os.fspath(path)
    shown = f"{what} {_shown_path(given)}"
    text = os.path.abspath(given)
    try:
        candidate = _final_trusted_name(text, trusted_uids)
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer for good.
        fd = os.open(
            candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        )
    except PathMissing as exc:
        where = f": {exc}" if str(exc) else ""  # the directory missing on the way
        raise PathMissing(f"{shown} does not exist{where}") from None
    except UnsafePathError as exc:
        raise UnsafePathError(f"{shown} refused: {exc}") from None
    except OSError as exc:
        raise UnsafePathError(f"{shown}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)  # the bytes read are those of the file checked
        reason = _untrusted_file_reason(info, trusted_uids, max_bytes)
        if reason:
            raise UnsafePathError(f"{shown} refused: {reason}")
        data = b""
        while len(data) <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise UnsafePathError(f"{shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnsafePathError(f"{shown} refused: it grew past {max_bytes} bytes while read")
    return data


def _final_trusted_name(text: str, trusted_uids: frozenset[int]) -> str:
    """The path of the file itself, its directory walked and checked, every trusted link
    at its end followed the same way; raises :class:`UnsafePathError`."""
    for _ in range(_MAX_SYMLINKS):
        parent, name = os.path.split(text)
        if not name or name in (".", ".."):
            raise UnsafePathError("it is a directory, not a regular file")
        directory = trusted_directory(parent, trusted=trusted_uids, allow_sticky=True)
        candidate = os.path.join(directory, name)
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            raise PathMissing("") from None
        if not stat.S_ISLNK(info.st_mode):
            return candidate
        if info.st_uid not in trusted_uids:
            raise UnsafePathError(
                f"{_shown_path(candidate)} is a symbolic link owned by "
                f"{describe_owner(info.st_uid)}: refusing to follow it"
            )
        target = os.readlink(candidate)
        text = os.path.normpath(os.path.join(directory, target))
    raise UnsafePathError("it has too many levels of symbolic links")


def _untrusted_file_reason(
    info: os.stat_result, trusted_uids: frozenset[int], max_bytes: int
) -> str:
    """Why the opened file cannot be trusted, or "" when it can."""
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        if stat.S_ISFIFO(mode):
            kind = "a FIFO"
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            kind = "a device"
        elif stat.S_ISDIR(mode):
            kind = "a directory"
        else:
            kind = "no regular file"
        return f"it is {kind}; only a regular file is read"
    if info.st_uid not in trusted_uids:
        return (
            f"it belongs to {describe_owner(info.st_uid)}, not to {describe_trusted(trusted_uids)}"
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it can be written by other users (mode {stat.S_IMODE(mode):04o}); chmod go-w it"
    if info.st_size > max_bytes:
        return f"it is {info.st_size} bytes, over the {max_bytes} bytes allowed"
    return ""
