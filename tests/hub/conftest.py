"""Fixtures of the hub test: the local install, two Unix users, the system broker, the hub.

They follow docs/deploy.md ("Trying it on one machine without systemd") step by step,
through the commands of :mod:`local_install`.  Everything a fixture starts is stopped
when the test ends, also when it fails: the hub's process tree (proxy, single-user
servers, kernels) and every process of the two test users, and the broker.  What the
test needs of the host it leaves as it found it, except the cached install in
/opt/gpushare-e2e and the two users (both reused by the next run).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from hub_driver import Hub, HubError
from local_install import (
    INSTALL_POLICY,
    PREFIX,
    STAFF,
    START_BROKER,
    START_HUB,
    STUDENT,
    Install,
    ensure_user,
    environment_without_venv,
    expand,
    run,
)

SYSTEM_RUNTIME_DIR = Path("/run/gpushare")
SYSTEM_SOCKET = SYSTEM_RUNTIME_DIR / "broker.sock"
START_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def as_root() -> None:
    """First of every fixture here, so that a skip costs no install: root, and no system
    broker of the host's at the path this test runs its own on (its socket is not even
    connected to: a connect would tell that broker who called)."""
    if os.geteuid() != 0:
        pytest.skip("the hub test creates Unix users and runs the system broker: run it as root")
    if SYSTEM_SOCKET.is_socket():
        pytest.skip(
            f"the host's own system broker has {SYSTEM_SOCKET}; this test runs its own there "
            "and leaves the host's alone"
        )


@pytest.fixture(scope="module")
def install(as_root) -> Install:
    """Steps 1-4 and 6: venv with the package and JupyterHub, proxy, IPython config."""
    install = Install(PREFIX)
    install.ensure()
    install.install_ipython_config()
    return install


@pytest.fixture(scope="module")
def users(as_root) -> tuple[str, str]:
    """Step 5: a student and a staff member, with homes; their leftovers from a last run gone."""
    ensure_user(STUDENT, "students")
    ensure_user(STAFF, "teachers")
    for name in (STUDENT, STAFF):
        kill_processes_of(name)
        home = Path(os.path.expanduser(f"~{name}"))
        for marker in [*home.glob("stop-*"), home / "training-progress"]:
            marker.unlink(missing_ok=True)
    return STUDENT, STAFF


@pytest.fixture(scope="module")
def workdir(as_root) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gps-hub-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ the system broker


@dataclass
class SystemBroker:
    """The root broker on /run/gpushare/broker.sock, started by step 8's command."""

    command: str
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                ["bash", "-c", f"exec {self.command}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment_without_venv(),
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the broker exited at start:\n{self.log.read_text()}")
            if answers(SYSTEM_SOCKET):
                return
            time.sleep(0.05)
        raise AssertionError(f"the broker did not answer in time:\n{self.log.read_text()}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, as systemd stops it; the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            raise AssertionError(f"the broker ignored SIGTERM for {timeout} s") from None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


def answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


@pytest.fixture(scope="module")
def system_broker(install, users, workdir) -> Iterator[SystemBroker]:
    """Steps 7-8: the example policy installed, the broker started as root."""
    created_runtime_dir = not SYSTEM_RUNTIME_DIR.exists()
    values = {
        "PREFIX": PREFIX,
        "CONFIG": workdir / "etc" / "broker.toml",
        "JOURNAL": workdir / "journal.sqlite",
    }
    run(INSTALL_POLICY, **values)
    broker = SystemBroker(command=expand(START_BROKER, **values), log=workdir / "broker.log")
    broker.start()
    try:
        yield broker
    finally:
        if broker.process is not None and broker.process.poll() is None:
            with contextlib.suppress(AssertionError):
                broker.stop()
        with contextlib.suppress(OSError):
            SYSTEM_SOCKET.unlink()
        if created_runtime_dir:
            shutil.rmtree(SYSTEM_RUNTIME_DIR, ignore_errors=True)


# ------------------------------------------------------------------ the hub


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


WALKTHROUGH = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"

# What the test adds to the walkthrough's hub config: ports of its own (another hub may
# run on this machine) and patient spawns (CI machines are small).
TEST_ONLY_HUB_SETTINGS = """
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
"""


def walkthrough_hub_config(*, password: str, token: str, users: set[str], **ports: int) -> str:
    """Step 9's hub config exactly as docs/deploy.md writes it, with the test's prefix,
    password, users and service token put where the admin would put theirs."""
    step = WALKTHROUGH.read_text().split("**9. The hub.**", 1)[1]
    block = step.split("```python\n", 1)[1].split("```", 1)[0]
    choices = {
        "/opt/gpushare/": f"{PREFIX}/",
        '"a trial password"': repr(password),
        "secrets.token_hex(32)": repr(token),
        '{"gps-alice", "gps-bob"}': repr(users),
    }
    for written, ours in choices.items():
        assert written in block, f"docs/deploy.md's step 9 no longer writes {written}"
        block = block.replace(written, ours)
    return block + TEST_ONLY_HUB_SETTINGS.format(**ports)


@dataclass
class RunningHub:
    hub: Hub
    process: subprocess.Popen
    log: Path
    password: str


@pytest.fixture(scope="module")
def hub(install, users, system_broker, workdir) -> Iterator[RunningHub]:
    """Step 9: JupyterHub with deploy/jupyterhub_config.py, a shared password, a service token."""
    port = free_port()
    token = secrets.token_hex(32)
    password = secrets.token_hex(8)
    config = workdir / "jupyterhub_config.py"
    config.write_text(
        walkthrough_hub_config(
            password=password,
            token=token,
            users=set(users),
            port=port,
            hub_port=free_port(),
            proxy_api_port=free_port(),
        )
    )
    log = workdir / "jupyterhub.log"
    hub_dir = workdir / "hub"
    hub_dir.mkdir()
    command = expand(START_HUB, PREFIX=PREFIX, HUB_CONFIG=config)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=hub_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment_without_venv(),
            start_new_session=True,
        )
    running = RunningHub(
        hub=Hub(url=f"http://127.0.0.1:{port}", token=token),
        process=process,
        log=log,
        password=password,
    )
    try:
        wait_for_hub(running)
        yield running
    finally:
        stop_hub(running, users)


def wait_for_hub(running: RunningHub) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            raise AssertionError(f"jupyterhub exited at start:\n{running.log.read_text()}")
        with contextlib.suppress(HubError, OSError):
            running.hub.api("GET", "/")
            return
        time.sleep(0.2)
    raise AssertionError(f"jupyterhub did not answer in time:\n{running.log.read_text()}")


def stop_hub(running: RunningHub, users: tuple[str, ...]) -> None:
    """Stop servers through the API, then the hub; then kill whatever of theirs is left."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        tree = psutil.Process(running.process.pid).children(recursive=True)
    for name in users:
        running.hub.stop_server(name)
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait(timeout=10)
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()
    for name in users:
        kill_processes_of(name)


def kill_processes_of(user: str) -> None:
    """Kill every process of a test user (single-user servers, kernels, strays)."""
    for process in psutil.process_iter(["pid", "username"]):
        if process.info["username"] == user:
            with contextlib.suppress(psutil.Error):
                process.kill()
