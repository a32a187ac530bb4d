"""A root broker takes orders only from a config that nobody else can have written.

Tried as an attacker would, with real Unix users (``gpsb`` the attacker) and a real root
broker on the simulated H200:

* a config file the attacker owns, a root file open to everyone's writes, the
  attacker's symbolic link, and root's link into a directory the attacker owns are each
  refused at start with one line naming the file and the reason; the attack that
  motivated this (write ``admin_users`` into the file, wait for the admin's
  ``reload-policy``) leaves the attacker without admin rights;
* a path that is no regular file (``/dev/zero``, a FIFO) is refused at once, without
  reading or waiting;
* a config nested thousands of levels deep is one ``invalid`` line, at start and through
  ``set-policy``;
* an escape sequence or a newline in a key never reaches the admin's terminal raw, and
  user or group names that are no account names are refused.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import is_root, launch_broker, run_as, short_tempdir

from gpushare_ext.broker.settings.config import CONFIG_MAX_BYTES, load_config, parse_config
from gpushare_ext.broker.settings.config_text import MAX_NESTING
from gpushare_ext.broker.settings.schema import PolicyError
from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.protocol import ErrorCode
from gpushare_ext.safe_fs import UnsafePathError, read_trusted_file

needs_root = pytest.mark.skipif(not is_root(), reason="drops to real Unix users: needs root")

GOOD_CONFIG = "[broker]\nadmin_users = []\n"
ATTACKER_CONFIG = '[broker]\nadmin_users = ["gpsb"]\n'


def _uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


def _broker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``gpushare broker --system`` on the simulated H200, in a socket place of root's."""
    place = short_tempdir()
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpushare_ext.cli", "broker", "--system", "--simulate",
             "h200", "--socket", str(place / "broker.sock"), "--journal", str(place / "j"),
             *args],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        shutil.rmtree(place, ignore_errors=True)


def _one_refusal_line(result: subprocess.CompletedProcess) -> str:
    """The broker's refusal: exit 1, no traceback, one line on stderr starting 'gpushare:'."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpushare: "), result.stderr
    assert "\x1b" not in result.stderr
    return lines[0]


def _write_as_attacker(path: str, text: str) -> None:
    Path(path).write_text(text)


def _link_as_attacker(path: str, target: str) -> None:
    os.symlink(target, path)


# ------------------------------------------------------------------ who wrote the file


@pytest.fixture
def place():
    """A root directory (0755, like /etc/gpushare) the attacker can read but not write."""
    directory = short_tempdir()
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@needs_root
@pytest.mark.multiuser
def test_a_config_the_attacker_owns_is_refused_naming_file_and_owner(two_users, place):
    _, attacker = two_users
    config = place / "broker.toml"
    config.write_text(ATTACKER_CONFIG)
    os.chown(config, _uid(attacker), -1)
    config.chmod(0o644)

    line = _one_refusal_line(_broker("--config", str(config)))

    assert str(config) in line and attacker in line and "belongs to" in line


@needs_root
def test_a_root_config_anyone_may_write_is_refused(place):
    config = place / "broker.toml"
    config.write_text(GOOD_CONFIG)
    config.chmod(0o666)

    line = _one_refusal_line(_broker("--config", str(config)))

    assert str(config) in line and "written by other users" in line and "0666" in line


@needs_root
def test_a_config_in_a_directory_others_may_write_is_refused(place):
    shared = place / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could swap the file
    config = shared / "broker.toml"
    config.write_text(GOOD_CONFIG)
    config.chmod(0o644)

    line = _one_refusal_line(_broker("--config", str(config)))

    assert str(shared) in line and "written by other users" in line


@needs_root
@pytest.mark.multiuser
def test_the_attackers_symbolic_link_to_a_config_is_refused(two_users, place):
    _, attacker = two_users
    mine = place / "attacker"
    mine.mkdir()
    os.chown(mine, _uid(attacker), -1)
    real = place / "real.toml"
    real.write_text(GOOD_CONFIG)
    link = mine / "broker.toml"
    run_as(attacker, _link_as_attacker, str(link), str(real))

    line = _one_refusal_line(_broker("--config", str(link)))

    assert str(link) in line and attacker in line


@needs_root
@pytest.mark.multiuser
def test_roots_link_into_a_directory_the_attacker_owns_is_refused(two_users, place):
    _, attacker = two_users
    mine = place / "attacker"
    mine.mkdir()
    os.chown(mine, _uid(attacker), -1)
    target = mine / "broker.toml"
    run_as(attacker, _write_as_attacker, str(target), ATTACKER_CONFIG)
    link = place / "broker.toml"
    link.symlink_to(target)  # root's own link, as an admin might make by mistake

    line = _one_refusal_line(_broker("--config", str(link)))

    assert str(link) in line and str(mine) in line and attacker in line


@needs_root
def test_roots_link_to_a_trusted_config_is_followed(place):
    real = place / "real.toml"
    real.write_text('[broker]\nadmin_users = ["gpuadmin"]\n')
    link = place / "broker.toml"
    link.symlink_to(real)

    assert load_config(link).policy.admin_users == ("gpuadmin",)


def _is_admin(socket_path: str) -> str:
    """What a drain of device 0 answers, asked as the caller."""
    with BrokerClient(Path(socket_path)) as client:
        try:
            client.admin("drain", device=0)
        except BrokerError as exc:
            return exc.code
    return "ok"


@needs_root
@pytest.mark.multiuser
def test_an_attacker_who_gets_to_write_the_config_never_becomes_admin(two_users):
    """The escalation itself: the config is opened to everyone by mistake, the attacker
    names herself admin in it, the admin reloads: the reload is refused in one line and
    she stays a user."""
    _, attacker = two_users
    running = launch_broker(system=True, config_toml=GOOD_CONFIG)
    try:
        config = running.directory / "broker.toml"
        config.chmod(0o666)
        run_as(attacker, _write_as_attacker, str(config), ATTACKER_CONFIG)

        reload = subprocess.run(
            [sys.executable, "-m", "gpushare_ext.cli", "admin", "--socket",
             str(running.socket), "reload-policy"],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip

        assert reload.returncode != 0, reload.stdout
        lines = reload.stderr.strip().splitlines()
        assert len(lines) == 1 and str(config) in lines[0], reload.stderr
        assert "written by other users" in lines[0]
        assert run_as(attacker, _is_admin, str(running.socket)) == ErrorCode.PERMISSION.value
    finally:
        running.stop(timeout=10)
        shutil.rmtree(running.directory, ignore_errors=True)


# ------------------------------------------------------------------ what the file is


@needs_root
def test_dev_zero_as_config_is_refused_without_reading_it():
    started = time.monotonic()
    line = _one_refusal_line(_broker("--config", "/dev/zero", timeout=30))
    assert "/dev/zero" in line and "a device" in line
    assert time.monotonic() - started < 20


@needs_root
def test_a_fifo_as_config_is_refused_without_waiting_for_a_writer(place):
    fifo = place / "broker.toml"
    os.mkfifo(fifo, 0o600)
    line = _one_refusal_line(_broker("--config", str(fifo), timeout=30))
    assert str(fifo) in line and "a FIFO" in line


def test_a_config_over_the_size_cap_is_refused_by_its_size(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text("# padding\n" * (CONFIG_MAX_BYTES // 10 + 1))
    with pytest.raises(PolicyError) as refused:
        load_config(config)
    assert str(config) in str(refused.value) and f"{CONFIG_MAX_BYTES} bytes" in str(refused.value)


def test_a_directory_as_config_is_refused(tmp_path):
    with pytest.raises(UnsafePathError, match="a directory"):
        read_trusted_file(tmp_path, trusted={os.geteuid()}, max_bytes=100, what="config")


def test_a_missing_config_names_the_file(tmp_path):
    missing = tmp_path / "nothing.toml"
    with pytest.raises(PolicyError, match=f"^config {missing} does not exist$"):
        load_config(missing)


# ------------------------------------------------------------------ what the file says


@pytest.mark.parametrize(
    "text",
    [
        "x = " + "[" * 5000 + "]" * 5000 + "\n",
        "x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n",
        "[broker]\nadmin_users = " + "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1),
    ],
    ids=["5000 nested arrays", "3000 nested inline tables", "just past the cap"],
)
def test_a_deeply_nested_config_is_one_invalid_line(text):
    with pytest.raises(PolicyError) as refused:
        parse_config(text, "deep.toml")
    message = str(refused.value)
    assert message == f"deep.toml nests tables or arrays more than {MAX_NESTING} levels deep"


def test_a_deeply_nested_config_at_start_is_one_line(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200",
         "--socket", str(tmp_path / "b.sock"), "--config", str(config)],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    line = _one_refusal_line(result)
    assert "levels deep" in line


def test_set_policy_with_a_deeply_nested_policy_is_invalid_not_internal(broker):
    with BrokerClient(broker) as client, pytest.raises(BrokerError) as refused:
        client.admin("set_policy", policy_toml="x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert refused.value.code == ErrorCode.INVALID.value
    assert "levels deep" in str(refused.value)
    assert "RecursionError" not in str(refused.value)


@pytest.mark.parametrize(
    "text",
    [
        '[broker]\n"evil\\u001b[2J\\u001b]0;owned\\u0007" = 1\n',
        '"sec\\ntion" = 1\n',
        '[users."al\\u001bice"]\nmax_priority = "low"\n',
        '[groups."line\\nbreak"]\nmax_priority = "low"\n',
    ],
    ids=[
        "escape in a broker key",
        "newline in a section",
        "escape in a user",
        "newline in a group",
    ],
)
def test_a_hostile_key_is_shown_as_plain_text(text):
    with pytest.raises(PolicyError) as refused:
        parse_config(text, "broker.toml")
    message = str(refused.value)
    assert all(ord(c) >= 0x20 and c != "\x7f" for c in message), repr(message)
    assert "\u241b" in message or "\u2424" in message  # the escape's or newline's picture


@pytest.mark.parametrize("name", ["al\u001bice", "bob smith", "x/y", "", "-dash", "a" * 300])
def test_admin_and_section_names_must_be_account_names(name):
    quoted = name.replace("\u001b", "\\u001b")
    with pytest.raises(PolicyError, match="admin_users"):
        parse_config(f'[broker]\nadmin_users = ["{quoted}"]\n')
    with pytest.raises(PolicyError, match="user or group name"):
        parse_config(f'[users."{quoted}"]\nmax_priority = "low"\n')


@pytest.mark.parametrize("name", ["alice", "j.doe", "alice@example.org", "DOMAIN\\\\bob", "m1$"])
def test_real_account_name_shapes_are_accepted(name):
    config = parse_config(
        f'[broker]\nadmin_users = ["{name}"]\n[users."{name}"]\nmax_priority = "low"\n'
    )
    assert config.policy.admin_users == (name.replace("\\\\", "\\"),)


def test_set_policy_error_for_a_hostile_key_reaches_the_cli_as_plain_text(broker, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('[broker]\n"evil\\u001b[2J\\u001b]0;owned\\u0007" = 1\n')
    result = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "admin", "--socket", str(broker),
         "set-policy", str(policy)],
        capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode != 0
    assert b"\x1b" not in result.stderr and b"\x07" not in result.stderr, result.stderr
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "unknown setting" in lines[0], result.stderr


def test_a_trusted_file_is_read_whole(tmp_path):
    config = tmp_path / "c.toml"
    config.write_bytes(b"x" * 100)
    config.chmod(0o644)
    assert read_trusted_file(config, trusted={os.geteuid()}, max_bytes=100) == b"x" * 100
    assert stat.S_IMODE(config.stat().st_mode) == 0o644  # reading changes nothing
