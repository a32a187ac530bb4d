"""Shared fixtures: a real broker subprocess on a simulated H200, and running code as a user.

``start_broker(...)`` starts ``gpushare broker --simulate ...`` on a socket in a fresh
short temporary directory (Unix socket paths are limited to 108 bytes), waits until it
answers a status request, and stops it with SIGTERM when the test ends.  ``broker`` is
the common case: the socket path of a user-mode broker on the shipped H200 readout.

``run_as(user, fn, *args)`` runs ``fn`` in a forked child that first became ``user``
(setgid/setuid; forked children need no interpreter of their own, so the root-only
Python is fine) and returns what it returned.  ``spawn_as`` keeps the child alive and
talks to it through a pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpushare_ext.broker.edges import launch
from gpushare_ext.paths import SHM_DIR, sessions_prefix_for
from gpushare_ext.safe_fs import remove_own_directory

BROKER_START_TIMEOUT_S = 15.0
_FORK = multiprocessing.get_context("fork")


class RunningBroker(launch.BrokerProcess):
    """A broker subprocess of a test; failures to start or stop are test failures."""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:  # type: ignore[override]
        """Send ``sig`` and wait for the exit status."""
        try:
            status = super().stop(sig, timeout)
        except launch.BrokerStartError:
            raise AssertionError(f"broker did not exit within {timeout} s after {sig}") from None
        assert status is not None, "the broker was never started"
        return status


def remove_sessions_left_by(socket_path: Path) -> None:
    """Remove the sessions directories a broker on ``socket_path`` left under /dev/shm.

    A broker a test killed (``kill -9``) and never started again on its socket leaves
    its directory: only the next broker on the same socket would remove it, and a test's
    socket is never used again.  Only this user's directories named after that socket,
    never through a link (``remove_own_directory``)."""
    prefix = sessions_prefix_for(socket_path)
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if name.startswith(prefix):
                remove_own_directory(SHM_DIR / name, ("*.cb",))


def short_tempdir(prefix: str = "gps-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def free_port(host: str = "127.0.0.1", family: socket.AddressFamily = socket.AF_INET) -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def launch_broker(
    *,
    directory: Path | None = None,
    simulate: str = "h200",
    config_toml: str | None = None,
    system: bool = False,
    metrics_port: int | None = None,
    journal: Path | None = None,
    extra_args: tuple[str, ...] = (),
    wait: bool = True,
) -> RunningBroker:
    """Start ``gpushare broker`` on a simulated inventory; return once it answers."""
    directory = directory or short_tempdir()
    directory.mkdir(parents=True, exist_ok=True)
    if system:
        # Other users must reach a system broker's socket; the broker never widens a
        # directory it did not create, so the test that made this one opens it.
        directory.chmod(0o755)
    extra = list(extra_args)
    if metrics_port is not None:
        extra += ["--metrics-port", str(metrics_port)]
    running = RunningBroker(
        directory,
        simulate=simulate,
        config_toml=config_toml,
        system=system,
        journal=journal or directory / "journal.sqlite",
        log_level="debug",
        extra_args=tuple(extra),
    )
    running.start(wait=False)
    if wait:
        try:
            running.wait_answering(BROKER_START_TIMEOUT_S)
        except launch.BrokerStartError as exc:
            with contextlib.suppress(Exception):
                running.stop(signal.SIGKILL, timeout=5)
            raise AssertionError(str(exc)) from None
    return running


@pytest.fixture
def start_broker() -> Iterator[Callable[..., RunningBroker]]:
    """Factory: ``start_broker(config_toml=..., simulate=..., system=...)``; all stopped after."""
    started: list[RunningBroker] = []

    def start(**kwargs) -> RunningBroker:
        running = launch_broker(**kwargs)
        started.append(running)
        return running

    yield start
    for running in started:
        if running.process.poll() is None:
            with contextlib.suppress(AssertionError):
                running.stop(signal.SIGTERM, timeout=10)
        remove_sessions_left_by(running.socket)
        shutil.rmtree(running.directory, ignore_errors=True)


@pytest.fixture
def running_broker(start_broker, request) -> RunningBroker:
    """A user-mode broker on the simulated H200 (a test may parametrize it indirectly
    with ``start_broker``'s arguments, e.g. another inventory)."""
    return start_broker(**getattr(request, "param", {}))


@pytest.fixture
def broker(running_broker: RunningBroker) -> Path:
    """The socket path of a user-mode broker on the simulated H200."""
    return running_broker.socket


# ------------------------------------------------------------------ running as a user


def become(user: str | None) -> None:
    """In a forked child: drop to ``user`` (no-op for None)."""
    if user is None:
        return
    entry = pwd.getpwnam(user)
    os.setgroups(os.getgrouplist(entry.pw_name, entry.pw_gid))
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    os.environ["HOME"] = entry.pw_dir
    os.environ["USER"] = entry.pw_name


def _child_main(user: str | None, fn: Callable, args: tuple, conn) -> None:
    try:
        become(user)
        result = ("ok", fn(*args))
    except BaseException as exc:
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(result)
    finally:
        conn.close()
        os._exit(0)


def run_as(user: str | None, fn: Callable, *args, timeout: float = 30.0):
    """Run ``fn(*args)`` in a forked child that became ``user``; return its (picklable) result."""
    parent, child = _FORK.Pipe()
    process = _FORK.Process(target=_child_main, args=(user, fn, args, child), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise AssertionError(f"child running as {user} did not finish within {timeout} s")
        status, value = parent.recv()
    finally:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    if status != "ok":
        raise AssertionError(f"child running as {user} failed: {value}")
    return value


@dataclass
class ForkedUser:
    """A live forked child running as some user; ``send``/``recv`` talk to its function."""

    process: multiprocessing.process.BaseProcess
    conn: object

    def send(self, value) -> None:
        self.conn.send(value)  # type: ignore[attr-defined]

    def recv(self, timeout: float = 30.0):
        if not self.conn.poll(timeout):  # type: ignore[attr-defined]
            raise AssertionError(f"forked child said nothing within {timeout} s")
        status, value = self.conn.recv()  # type: ignore[attr-defined]
        if status == "error":
            raise AssertionError(f"forked child failed: {value}")
        return value

    @property
    def pid(self) -> int:
        return self.process.pid  # type: ignore[return-value]

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


def _spawned_main(user: str | None, fn: Callable, args: tuple, conn) -> None:
    class Channel:
        def send(self, value) -> None:
            conn.send(("ok", value))

        def recv(self):
            return conn.recv()

    try:
        become(user)
        fn(Channel(), *args)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        os._exit(0)


def spawn_as(user: str | None, fn: Callable, *args) -> ForkedUser:
    """Start ``fn(channel, *args)`` in a forked child that became ``user``; it stays alive."""
    parent, child = _FORK.Pipe()
    process = _FORK.Process(target=_spawned_main, args=(user, fn, args, child), daemon=True)
    process.start()
    child.close()
    return ForkedUser(process=process, conn=parent)


@pytest.fixture
def forked_users() -> Iterator[Callable[..., ForkedUser]]:
    """Factory around :func:`spawn_as` that kills every child at the end of the test."""
    children: list[ForkedUser] = []

    def spawn(user: str | None, fn: Callable, *args) -> ForkedUser:
        child = spawn_as(user, fn, *args)
        children.append(child)
        return child

    yield spawn
    for child in children:
        child.stop()


def is_root() -> bool:
    return os.geteuid() == 0


TEST_USERS = ("gpsa", "gpsb")


def ensure_users(*names: str) -> tuple[str, ...]:
    """Real Unix users (no home, no shell) for tests that cross users; needs root."""
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=True, capture_output=True,
            )  # fmt: skip
    return names


@pytest.fixture(scope="session")
def two_users() -> tuple[str, ...]:
    """Two real Unix users: ``gpsa`` (a victim, say) and ``gpsb`` (another user)."""
    if not is_root():
        pytest.skip("creates Unix users and drops to them: needs root")
    return ensure_users(*TEST_USERS)
