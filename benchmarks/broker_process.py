"""The broker that GPU benchmarks and GPU tests run their tenants beside.

``gpushare broker`` on the real GPUs (NVML inventory), its socket, journal, log and
config in one working folder, started by
:class:`gpushare_ext.broker.edges.launch.BrokerProcess`, the one way a broker is started as a
child process; :func:`start_broker` hands back the plain child process, which the caller
terminates (``broker.terminate(); broker.wait(...)``), and it is tracked so that a
benchmark ended by a signal stops it too.

This module only starts a broker and waits until it answers: it measures nothing, and
it never stops a broker it did not start.
"""

from __future__ import annotations

import os
import subprocess
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


def start_broker(workdir: Path, config: str | None = None) -> tuple[subprocess.Popen, Path]:
    """Start a broker in ``workdir`` (its log: ``broker.log`` there) and wait until it
    answers; the process and its socket."""
    from gpushare_ext.broker.edges.launch import BrokerProcess, BrokerStartError

    broker = BrokerProcess(
        workdir,
        simulate=None,
        config_toml=config or None,
        # "info": one line per lease event: grants, pauses and how long each stop took.
        log_level="info",
        env=checkout_env(None),
    )
    broker.start(wait=False)
    assert broker.process is not None
    process = track(broker.process)
    try:
        broker.wait_answering(START_TIMEOUT_S)
    except BrokerStartError:
        stop(process)  # it may run without answering: it must not stay behind
        raise RuntimeError("broker did not start: " + broker.output()[-3000:]) from None
    return process, broker.socket
