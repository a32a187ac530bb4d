"""The broker that GPU benchmarks and GPU tests run their tenants beside.

``gpushare broker`` on the real GPUs (NVML inventory), its socket, journal, log and
config in one working folder.  The command line is the one
:class:`gpushare_ext.broker.edges.launch.BrokerProcess` builds, so that it is written in one
place; :func:`start_broker` runs it as a plain child process the caller terminates
(``broker.terminate(); broker.wait(...)``), and it is tracked so that a benchmark ended
by a signal stops it too.

This module only starts a broker and waits until it answers: it measures nothing, and
it never stops a broker it did not start.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from benchmarks.stopping import stop, track

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


def checkout_env(socket_path: Path | None) -> dict[str, str]:
    """This process's environment with this checkout importable, pointed at the broker
    on ``socket_path`` (None: at no broker)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if socket_path is not None:
        env["GPUSHARE_SOCKET"] = str(socket_path)
    else:
        env.pop("GPUSHARE_SOCKET", None)
    return env


def broker_argv(
    workdir: Path,
    config: str | None = None,
    *,
    socket_name: str = "broker.sock",
    journal_name: str = "journal.sqlite",
    log_level: str = "info",
) -> list[str]:
    """``gpushare broker --inventory nvml`` with its socket and journal in ``workdir``;
    ``config``, when given, is written to ``workdir/broker.toml`` and passed."""
    from gpushare_ext.broker.edges.launch import BrokerProcess

    return BrokerProcess(
        workdir,
        simulate=None,
        config_toml=config or None,
        socket_name=socket_name,
        journal=workdir / journal_name,
        log_level=log_level,
    ).argv()


def start_broker(workdir: Path, config: str | None = None) -> tuple[subprocess.Popen, Path]:
    """Start a broker in ``workdir`` (its log: ``broker.log`` there) and wait until it
    answers; the process and its socket."""
    socket_path = workdir / "broker.sock"
    # "info": one line per lease event: grants, pauses and how long each stop took.
    command = broker_argv(workdir, config, log_level="info")
    log = open(workdir / "broker.log", "ab")  # noqa: SIM115
    process = track(subprocess.Popen(command, stdout=log, stderr=log, env=checkout_env(None)))
    from gpushare_ext.runtime.embedded import broker_answers

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if broker_answers(socket_path):
            return process, socket_path
        if process.poll() is not None:
            break
        time.sleep(0.1)
    stop(process)  # it may run without answering: it must not stay behind
    raise RuntimeError("broker did not start: " + (workdir / "broker.log").read_text()[-3000:])
