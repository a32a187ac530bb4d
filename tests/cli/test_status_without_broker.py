"""``gpushare status`` that finds no broker names the fix in its one line, and the fix it
names works: the command it quotes starts a broker that the same ``gpushare status``
then finds.  Run as a user runs it: real subprocesses, a private runtime folder."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpushare_ext.paths import SYSTEM_SOCKET

BROKER_START_TIMEOUT_S = 30.0


def _environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This user's default socket in ``tmp_path`` (and the journal too), no override."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("GPUSHARE_SOCKET", None)
    return {**env, **extra}


def _status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "status", *args],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


def _named_command(stderr: str) -> list[str]:
    """The broker command the line quotes (the first `gpushare broker ...` in it)."""
    quoted = re.search(r"`(gpushare broker[^`]*)`", stderr)
    assert quoted, stderr
    # Run the module rather than the script, whichever environment the tests run in.
    return [sys.executable, "-m", "gpushare_ext.cli", *shlex.split(quoted.group(1))[1:]]


def _the_named_fix_starts_a_broker_status_finds(
    stderr: str, env: dict[str, str], *status_args: str
) -> None:
    # No GPU here: the broker falls back to the simulated H200 on its own.
    broker = subprocess.Popen(
        _named_command(stderr), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        while (found := _status(env, *status_args)).returncode != 0:
            assert broker.poll() is None, "the broker the line names exited"
            assert time.monotonic() < deadline, found.stderr
            time.sleep(0.2)
        assert "gpushare on " in found.stdout
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(timeout=30)


def test_status_on_the_default_socket_names_gpushare_broker_and_a_gpu_cell(tmp_path):
    env = _environment(tmp_path)

    result = _status(env)

    socket_path = tmp_path / "gpushare" / "broker.sock"
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"gpushare: no broker is listening on {socket_path} (no such file). Start one with "
        "`gpushare broker`, or run a `%%gpu` cell in a notebook, which starts one for you.\n"
    )
    _the_named_fix_starts_a_broker_status_finds(result.stderr, env)


@pytest.mark.parametrize(
    ("chosen_by", "folder"),
    [("--socket", "elsewhere"), ("GPUSHARE_SOCKET", "elsewhere"), ("--socket", "my sockets")],
)
def test_status_on_a_chosen_socket_names_the_broker_command_for_that_socket(
    chosen_by, folder, tmp_path
):
    socket_path = tmp_path / folder / "broker.sock"
    socket_path.parent.mkdir()
    if chosen_by == "--socket":
        env, args = _environment(tmp_path), ("--socket", str(socket_path))
    else:
        env, args = _environment(tmp_path, GPUSHARE_SOCKET=str(socket_path)), ()

    result = _status(env, *args)

    # A %%gpu cell starts no broker on a socket someone chose: the line does not offer it.
    assert result.returncode == 1
    assert result.stderr == (
        f"gpushare: no broker is listening on {socket_path} (no such file). Start one there "
        f"with `gpushare broker --socket {shlex.quote(str(socket_path))}`.\n"
    )
    _the_named_fix_starts_a_broker_status_finds(result.stderr, env, *args)


def test_status_on_the_system_socket_sends_the_user_to_the_admin():
    from gpushare_ext.cli import _how_to_start_a_broker

    assert _how_to_start_a_broker(SYSTEM_SOCKET, chosen=False) == (
        "The admin starts the system broker (ask yours)"
    )
