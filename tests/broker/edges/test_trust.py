"""Nobody can hijack a session through the file system or by standing in for the broker.

Tried as an attacker would, with two real Unix users (``gpsa`` the victim, ``gpsb`` the
attacker) and a real root broker:

* a runtime directory prepared by the attacker (a 0777 directory, a link, a directory
  with a fake broker in it) is refused in one line, and the victim's session sends the
  fake broker nothing;
* a listener that runs as another user, or that does not speak as a broker, is refused
  in one line;
* a root broker given a socket or control-block place another user prepared refuses it
  and touches nothing there; it never ``chmod``-s a directory it did not create;
* a control block another user owns is never accepted.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import is_root, launch_broker, run_as, short_tempdir

from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.control_block import ControlBlock, ControlBlockError
from gpushare_ext.paths import sessions_prefix_for
from gpushare_ext.protocol import Granted, Ok, encode_frame
from gpushare_ext.runtime.embedded import EmbeddedBrokerError, ensure_embedded_broker

needs_root = pytest.mark.skipif(not is_root(), reason="drops to real Unix users: needs root")
pytestmark = [pytest.mark.multiuser, needs_root]


def _uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def victim_runtime(two_users):
    """The victim's embedded-broker directory, /tmp/gpushare-<uid>, absent at the start."""
    victim, _ = two_users
    path = Path(f"/tmp/gpushare-{_uid(victim)}")
    _remove(path)
    yield path
    _remove(path)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


# ------------------------------------------------------------------ the victim's side


def _make_dir(path: str, mode: int) -> None:
    os.mkdir(path)
    os.chmod(path, mode)


def _make_link(path: str, target: str) -> None:
    os.symlink(target, path)


def _start_embedded_as_victim() -> str:
    os.environ.pop("XDG_RUNTIME_DIR", None)
    os.environ.pop("GPUSHARE_SOCKET", None)
    try:
        ensure_embedded_broker(timeout=5)
    except EmbeddedBrokerError as exc:
        return str(exc)
    return "started"


@pytest.mark.parametrize("kind", ["world-writable directory", "attacker's own directory", "link"])
def test_a_runtime_directory_prepared_by_another_user_is_refused_in_one_line(
    two_users, victim_runtime, kind, tmp_path
):
    victim, attacker = two_users
    if kind == "link":
        target = tmp_path / "victims-dir"
        target.mkdir()
        os.chown(target, _uid(victim), -1)
        target.chmod(0o755)
        run_as(attacker, _make_link, str(victim_runtime), str(target))
    else:
        mode = 0o777 if kind == "world-writable directory" else 0o755
        run_as(attacker, _make_dir, str(victim_runtime), mode)
    before = (os.lstat(victim_runtime).st_mode, os.lstat(victim_runtime).st_uid)

    message = run_as(victim, _start_embedded_as_victim)

    assert message.startswith(f"gpushare: {victim_runtime}"), message
    assert "\n" not in message
    assert f"{attacker} (uid {_uid(attacker)})" in message
    assert "intercept" in message
    # Refused, not repaired: the attacker's thing is as it was, nothing was made in it.
    assert (os.lstat(victim_runtime).st_mode, os.lstat(victim_runtime).st_uid) == before
    if kind != "link":
        assert os.listdir(victim_runtime) == []


def _attacker_socket(path: str, timeout: float) -> socket.socket:
    """The attacker's listening socket where the victim will look (its own directory)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.chmod(os.path.dirname(path), 0o755)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(4)
    server.settimeout(timeout)
    return server


def _fake_broker(channel, path: str) -> None:
    """The attacker: listen where the victim will look, record every byte received."""
    server = _attacker_socket(path, 0.2)
    received = b""
    channel.send("listening")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(socket.timeout):
            peer, _ = server.accept()
            peer.settimeout(1.0)
            with contextlib.suppress(OSError):
                while chunk := peer.recv(65536):
                    received += chunk
            peer.close()
        if os.path.exists(path + ".done"):
            break
    channel.send(received)


def _victim_connects(path: str) -> tuple[str, str]:
    try:
        BrokerClient(path, notebook="thesis/secret.ipynb", connect_timeout=3).close()
    except BrokerError as exc:
        return type(exc).__name__, str(exc)
    return "connected", ""


def test_a_fake_broker_of_another_user_gets_nothing_from_the_victim(
    two_users, victim_runtime, forked_users
):
    victim, attacker = two_users
    socket_path = victim_runtime / "broker.sock"
    fake = forked_users(attacker, _fake_broker, str(socket_path))
    assert fake.recv() == "listening"

    kind, message = run_as(victim, _victim_connects, str(socket_path))

    Path(str(socket_path) + ".done").touch()
    assert kind == "UntrustedBroker", message
    assert "\n" not in message and str(victim_runtime) in message and attacker in message
    assert fake.recv() == b""  # no hello: no pid, no notebook name, no cell label


def _counting_listener(channel, path: str) -> None:
    """The attacker: a socket where the victim's kernel looks; counts the connections it
    accepts (each one tells it the caller's pid, uid and gid through SO_PEERCRED)."""
    server = _attacker_socket(path, 0.1)
    accepted = 0
    channel.send("listening")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not os.path.exists(path + ".done"):
        with contextlib.suppress(socket.timeout):
            peer, _ = server.accept()
            accepted += 1
            peer.close()
    channel.send(accepted)


def _victim_kernel_connects() -> str:
    """A notebook kernel's first %%gpu cell: no system broker, XDG_RUNTIME_DIR unset."""
    os.environ.pop("XDG_RUNTIME_DIR", None)
    os.environ.pop("GPUSHARE_SOCKET", None)
    from gpushare_ext.runtime.session import GpuSession

    try:
        GpuSession().connect()
    except Exception as exc:  # the one-line refusal is what the user sees
        return f"{type(exc).__name__}: {exc}"
    return "connected"


def test_a_kernel_never_connects_to_a_socket_in_a_directory_another_user_prepared(
    two_users, victim_runtime, forked_users
):
    """Not even a bare connect(): accepting it would tell the squatter the kernel's pid,
    uid and gid and when it starts a session."""
    victim, attacker = two_users
    socket_path = victim_runtime / "broker.sock"
    squatter = forked_users(attacker, _counting_listener, str(socket_path))
    assert squatter.recv() == "listening"

    said = run_as(victim, _victim_kernel_connects)

    Path(str(socket_path) + ".done").touch()
    assert squatter.recv() == 0, said
    assert said.startswith("EmbeddedBrokerError: gpushare: "), said
    assert "\n" not in said and attacker in said and "intercept" in said


def _listen_as(channel, path: str, user: str, reply: bytes | None) -> None:
    """Bind as root (so the socket file is root's), then listen as ``user``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    if user != "root":
        entry = pwd.getpwnam(user)
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
    server.listen(4)  # SO_PEERCRED reports who called listen()
    channel.send("listening")
    server.settimeout(20)
    with contextlib.suppress(OSError):
        peer, _ = server.accept()
        peer.settimeout(3)
        with contextlib.suppress(OSError):
            peer.recv(65536)
            if reply is not None:
                peer.sendall(reply)
            time.sleep(2)
        peer.close()


def test_a_listener_running_as_another_user_is_refused(two_users, forked_users):
    victim, attacker = two_users
    directory = short_tempdir()
    directory.chmod(0o755)
    path = directory / "broker.sock"
    try:
        fake = forked_users(None, _listen_as, str(path), attacker, None)
        assert fake.recv() == "listening"

        kind, message = run_as(victim, _victim_connects, str(path))

        assert kind == "UntrustedBroker", message
        assert f"runs as {attacker} (uid {_uid(attacker)})" in message
        assert "\n" not in message
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_gpushare_status_against_a_peer_that_is_no_broker_says_so_in_one_line(forked_users):
    directory = short_tempdir()
    path = directory / "broker.sock"
    try:
        fake = forked_users(None, _listen_as, str(path), "root", encode_frame(Ok(reply_to=1)))
        assert fake.recv() == "listening"

        result = subprocess.run(
            [sys.executable, "-m", "gpushare_ext.cli", "status", "--socket", str(path)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip

        assert result.returncode == 1
        assert "Traceback" not in result.stderr and "AssertionError" not in result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"gpushare: the peer on {path} answered Ok"), line
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _open_block(path: str) -> str:
    try:
        ControlBlock.open(path).close()
    except ControlBlockError as exc:
        return str(exc)
    return "accepted"


def test_a_control_block_owned_by_another_user_is_never_accepted(two_users):
    victim, attacker = two_users
    directory = short_tempdir()
    directory.chmod(0o755)
    try:
        block = ControlBlock.create(directory / "fake.cb", owner_uid=_uid(attacker))
        block.close()
        os.chmod(directory / "fake.cb", 0o666)  # the attacker made it writable for the victim

        message = run_as(victim, _open_block, str(directory / "fake.cb"))

        assert f"belongs to uid {_uid(attacker)}, not to you" in message
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ------------------------------------------------------------------ the root broker's side


def _broker_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["directory", "link"])
def test_a_root_broker_refuses_a_socket_directory_another_user_controls(two_users, kind):
    _, attacker = two_users
    base = short_tempdir()
    base.chmod(0o1777)  # like /tmp: everyone may create names here
    precious = short_tempdir()  # root's, with something in it
    (precious / "keep.txt").write_text("root's file")
    precious.chmod(0o750)
    place = base / "x"
    private = short_tempdir()  # the journal's: the broker refuses one in a shared place
    try:
        if kind == "directory":
            run_as(attacker, _make_dir, str(place), 0o777)
        else:
            run_as(attacker, _make_link, str(place), str(precious))

        result = _broker_command(
            "--system", "--socket", str(place / "broker.sock"), "--journal", str(private / "j")
        )

        assert result.returncode == 1
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"gpushare: {place}"), result.stderr
        assert attacker in line
        assert _mode(precious) == 0o750 and (precious / "keep.txt").exists()
        assert not (precious / "broker.sock").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(precious, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def test_a_broker_never_changes_the_mode_of_a_directory_it_did_not_create():
    shared = short_tempdir()
    shared.chmod(0o1777)  # a stand-in for /tmp
    private = short_tempdir()
    broker = None
    try:
        broker = launch_broker(directory=shared, journal=private / "journal.sqlite")
        with BrokerClient(broker.socket) as client:
            assert isinstance(client.request_lease(priority=150), Granted)
        assert _mode(shared) == 0o1777
        assert _mode(broker.socket) == 0o600
    finally:
        if broker is not None:
            broker.stop()
        assert _mode(shared) == 0o1777
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def test_a_link_in_dev_shm_named_like_the_sessions_directory_is_left_alone(two_users):
    """The old fixed name under /dev/shm: a link there must not redirect a chmod or unlink."""
    _, attacker = two_users
    directory = short_tempdir()
    precious = short_tempdir()
    (precious / "old.cb").write_text("root's file that looks like a control block")
    precious.chmod(0o755)
    legacy = Path("/dev/shm") / sessions_prefix_for(directory / "broker.sock").rstrip("-")
    _remove(legacy)
    broker = None
    try:
        run_as(attacker, _make_link, str(legacy), str(precious))
        broker = launch_broker(directory=directory)
        with BrokerClient(broker.socket) as client:
            block = Path(client.welcome.control_block)
            assert block.parent.parent == Path("/dev/shm")
            assert block.parent.name.startswith(sessions_prefix_for(broker.socket))
            assert _mode(block.parent) == 0o700
        assert _mode(precious) == 0o755
        assert (precious / "old.cb").exists()
        assert legacy.is_symlink()
    finally:
        if broker is not None:
            broker.stop()
        _remove(legacy)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(precious, ignore_errors=True)


def test_sessions_directories_are_removed_at_stop_and_after_a_crash():
    broker = launch_broker()
    try:
        with BrokerClient(broker.socket) as client:
            first = Path(client.welcome.control_block).parent
        assert first.is_dir()
        broker.kill9()
        assert first.is_dir()  # a crash leaves it ...
        restarted = launch_broker(directory=broker.directory, journal=broker.journal)
        with BrokerClient(restarted.socket) as client:
            second = Path(client.welcome.control_block).parent
        assert not first.exists()  # ... and the next broker on that socket removes it
        assert restarted.stop(signal.SIGTERM) == 0
        assert not second.exists()  # a clean stop removes its own
    finally:
        if broker.process.poll() is None:
            broker.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)
