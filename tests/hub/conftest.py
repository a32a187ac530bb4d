"""Fixtures of the hub test: docs/deploy.md's walkthrough run on this machine, step by step.

``walkthrough`` reads the page and puts the test's paths and ports in it (before anything
is installed, so a page the test cannot follow fails first); the fixtures after it run
its steps in order through :mod:`local_install`, which checks each step's promises:
``install`` steps 1-4, ``users`` step 5, ``kernel_config`` step 6, ``system_broker`` steps
7-8 and ``hub`` step 9.  Everything a fixture starts is stopped when the test ends, also
when it fails: the hub's process tree (proxy, single-user servers, kernels) and every
process of the two test users, and the broker.  What the test needs of the host it
leaves as it found it, except the cached install in /opt/gpushare-e2e, the proxy npm
installed and the two users (all reused by the next run).
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
    REPO,
    STAFF,
    STUDENT,
    Choices,
    LocalInstall,
    environment_without_venv,
    failure,
    prepare,
)
from support import free_port

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
def workdir(as_root) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gps-hub-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def walkthrough(workdir) -> LocalInstall:
    """docs/deploy.md's walkthrough with this run's folder, ports and password in it."""
    choices = Choices(
        workdir=workdir,
        port=free_port(),
        hub_port=free_port(),
        proxy_api_port=free_port(),
        password=secrets.token_hex(8),
    )
    return LocalInstall(prepare(choices))


@pytest.fixture(scope="module")
def install(walkthrough) -> LocalInstall:
    """Steps 1-4: the venv with the package and JupyterHub, everyone's rights, the proxy."""
    walkthrough.install_environment()
    return walkthrough


@pytest.fixture(scope="module")
def users(install) -> tuple[str, str]:
    """Step 5: a student and a staff member, with homes; their leftovers from a last run gone."""
    install.add_users()
    for name in (STUDENT, STAFF):
        kill_processes_of(name)
        home = Path(os.path.expanduser(f"~{name}"))
        for marker in [*home.glob("stop-*"), home / "training-progress"]:
            marker.unlink(missing_ok=True)
    return STUDENT, STAFF


@pytest.fixture(scope="module")
def kernel_config(install, users) -> None:
    """Step 6: %%gpu in every kernel of the prefix."""
    install.install_kernel_config()


# ------------------------------------------------------------------ the system broker


@dataclass
class SystemBroker:
    """The root broker on /run/gpushare/broker.sock, started by step 8's block."""

    script: str  # the block after the variables, its command exec'd: its pid is the broker's
    step: str  # how a failure to start names it
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                ["bash", "-c", self.script],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment_without_venv(),
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise failure(
                    self.step,
                    f"the broker exited at start:\n{self.log.read_text()}",
                )
            if answers(SYSTEM_SOCKET):
                return
            time.sleep(0.05)
        raise failure(
            self.step,
            f"the broker did not answer in {START_TIMEOUT_S} s:\n{self.log.read_text()}",
        )

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
def system_broker(install, kernel_config, workdir) -> Iterator[SystemBroker]:
    """Steps 7-8: the example policy installed, the broker started as root and checked."""
    created_runtime_dir = not SYSTEM_RUNTIME_DIR.exists()
    install.install_policy()
    broker = SystemBroker(
        script=install.background_script(8),
        step=install.prepared.background_block(8).name,
        log=workdir / "broker.log",
    )
    try:
        broker.start()
        install.check_broker(SYSTEM_RUNTIME_DIR)
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


@dataclass
class RunningHub:
    hub: Hub
    process: subprocess.Popen
    log: Path
    password: str
    step: str  # how a failure names it


@pytest.fixture(scope="module")
def hub(install, users, system_broker, workdir) -> Iterator[RunningHub]:
    """Step 9: the page's hub config (deploy/jupyterhub_config.py, a shared password, the
    service token of its root-only file), started from its state folder."""
    token = install.write_hub_config()
    log = workdir / "jupyterhub.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            ["bash", "-c", install.background_script(9)],
            cwd=REPO,  # the block cds to the hub's state folder itself
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment_without_venv(),
            start_new_session=True,
        )
    running = RunningHub(
        hub=Hub(url=f"http://127.0.0.1:{install.choices.port}", token=token),
        process=process,
        log=log,
        password=install.choices.password,
        step=install.prepared.background_block(9).name,
    )
    try:
        wait_for_hub(running)
        install.check_hub_state()
        try:  # the service's role: it may list the users (the test starts their servers)
            running.hub.api("GET", "/users")
        except HubError as exc:
            raise failure(running.step, f"the service token's role: {exc}") from None
        yield running
    finally:
        stop_hub(running, users)


def wait_for_hub(running: RunningHub) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            raise failure(running.step, f"jupyterhub exited at start:\n{running.log.read_text()}")
        with contextlib.suppress(HubError, OSError):
            running.hub.api("GET", "/")
            return
        time.sleep(0.2)
    raise failure(
        running.step,
        f"jupyterhub did not answer in {START_TIMEOUT_S} s:\n{running.log.read_text()}",
    )


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
