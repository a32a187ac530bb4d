"""Starting a broker as a child process: the one way the demo, the tests and the benchmarks do it.

:class:`BrokerProcess` runs ``gpushare broker`` with its own socket, journal and log in
one directory, waits until it answers a status request, and stops it with a signal of
the caller's choice (SIGTERM for a clean stop, SIGKILL for a crash) so that the same
directory can be started again.  It is a thin wrapper over ``subprocess``: everything
the broker does, it does in the child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpushare_ext.broker.errors import DaemonError

START_TIMEOUT_S = 30.0


class BrokerStartError(DaemonError, RuntimeError):
    """The broker exited or did not answer; the message holds the tail of its log."""


@dataclass
class BrokerProcess:
    directory: Path
    simulate: str | None = "h200"  # None: the real GPUs through NVML
    config_toml: str | None = None
    system: bool = False
    socket_name: str = "broker.sock"
    journal: Path | None = None
    log_level: str = "info"
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def socket(self) -> Path:
        return self.directory / self.socket_name

    @property
    def journal_path(self) -> Path:
        return self.journal or self.directory / "journal.sqlite"

    @property
    def log(self) -> Path:
        return self.directory / "broker.log"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "gpushare_ext.cli", "broker"]
        argv += ["--simulate", self.simulate] if self.simulate else ["--inventory", "nvml"]
        argv += ["--socket", str(self.socket), "--journal", str(self.journal_path)]
        argv += ["--log-level", self.log_level]
        if self.system:
            argv.append("--system")
        if self.config_toml is not None:
            config = self.directory / "broker.toml"
            config.write_text(self.config_toml)
            argv += ["--config", str(config)]
        return [*argv, *self.extra_args]

    def start(self, wait: bool = True, timeout: float = START_TIMEOUT_S) -> BrokerProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env.pop("GPUSHARE_SOCKET", None)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        if wait:
            self.wait_answering(timeout)
        return self

    def answers(self) -> bool:
        from gpushare_ext.client import BrokerClient, BrokerError

        if not self.socket.exists():
            return False
        try:
            with BrokerClient(self.socket, client="cli", connect_timeout=2) as client:
                client.status()
        except BrokerError:
            return False
        return True

    def wait_answering(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise BrokerStartError(
                    f"the broker exited with {self.process.returncode}:\n{self.output()[-3000:]}"
                )
            if self.answers():
                return
            time.sleep(0.05)
        raise BrokerStartError(
            f"the broker did not answer within {timeout:g} s:\n{self.output()[-3000:]}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Send ``sig`` and return the exit status (negative: killed by that signal)."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
            raise BrokerStartError(f"the broker ignored signal {sig} for {timeout:g} s") from None

    def kill9(self) -> None:
        self.stop(signal.SIGKILL, timeout=10)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")
        return ""
