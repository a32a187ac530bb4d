"""The embedded per-user broker: started on demand when no broker answers.

With no system broker on the host, the first ``%%gpu`` cell of a user starts
``gpushare broker`` in user mode as a detached process (its own session, so it
outlives the kernel that started it) and says so once.  Every other notebook of the
same user finds it on the same socket.  A file lock keeps two kernels that start at
the same moment from starting two brokers.  It exits :data:`EMBEDDED_LIFETIME` after
its last notebook session and lease are gone.

The runtime directory is made private (0700) if it is missing and trusted only if it
is this user's and closed to others: one prepared by another user (a directory, a
link) is refused with a one-line :class:`EmbeddedBrokerError`, never used or fixed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpushare_ext.paths import trusted_broker_uids, user_runtime_dir
from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.safe_fs import (
    UnsafePathError,
    check_socket,
    open_private_file,
    trusted_directory,
)

# The embedded broker exits this long after its last session and lease are gone (it
# says so in its log); the next %%gpu cell starts another.
EMBEDDED_LIFETIME = "10m"


class EmbeddedBrokerError(SessionError):
    """The embedded broker could not be started; the message includes the tail of its log."""


def prepare_runtime_dir(runtime: Path) -> Path:
    """This user's runtime directory, made 0700 if missing; EmbeddedBrokerError if unsafe."""
    try:
        return trusted_directory(
            runtime,
            trusted={os.getuid()},
            create_mode=0o700,
            hint="another user may be trying to intercept your sessions; remove it, or set "
            "XDG_RUNTIME_DIR to a directory of yours",
        )
    except UnsafePathError as exc:
        raise EmbeddedBrokerError(f"gpushare: {exc}") from None


def broker_answers(path: Path, timeout: float = 0.5) -> bool:
    """Whether a broker listens on ``path``.  Only a socket this user could trust is
    tried at all: a bare ``connect()`` already tells whoever listens the caller's pid,
    uid and gid (``SO_PEERCRED``), so a socket in a directory another user prepared is
    never touched (the caller then refuses that directory in one line)."""
    try:
        resolved = check_socket(path, trusted=trusted_broker_uids())
    except (OSError, UnsafePathError):  # nothing there, or nothing this user may trust
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(resolved))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def ensure_embedded_broker(
    socket_path: Path | None = None, *, timeout: float = 20.0
) -> tuple[Path, bool]:
    """Make sure this user's broker answers; return (socket, started_now)."""
    runtime = user_runtime_dir() if socket_path is None else socket_path.parent
    socket_path = socket_path or runtime / "broker.sock"
    runtime = prepare_runtime_dir(runtime)
    if broker_answers(socket_path):
        return socket_path, False
    lock_path = runtime / "embedded.lock"
    try:
        lock_fd = open_private_file(lock_path, os.O_RDWR | os.O_CREAT)
    except UnsafePathError as exc:
        raise EmbeddedBrokerError(f"gpushare: {exc}") from None
    with open(lock_fd, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if broker_answers(socket_path):  # another kernel won the race
            return socket_path, False
        log_path = runtime / "broker.log"
        command = [
            sys.executable, "-m", "gpushare_ext.cli", "broker", "--socket", str(socket_path),
            "--exit-when-idle", EMBEDDED_LIFETIME,
        ]  # fmt: skip
        inventory = os.environ.get("GPUSHARE_INVENTORY")
        if inventory:
            command += (
                ["--simulate", inventory]
                if inventory not in ("auto", "nvml")
                else ["--inventory", inventory]
            )
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the broker sees every GPU
        try:
            log_fd = open_private_file(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        except UnsafePathError as exc:
            raise EmbeddedBrokerError(f"gpushare: {exc}") from None
        with open(log_fd, "ab") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env=env,
                close_fds=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if broker_answers(socket_path):
                return socket_path, True
            if process.poll() is not None:
                break
            time.sleep(0.05)
        tail = ""
        with contextlib.suppress(OSError):
            tail = log_path.read_text()[-2000:]
        raise EmbeddedBrokerError(
            f"the embedded broker did not start (exit status {process.poll()}); log {log_path}:\n{tail}"
        )
