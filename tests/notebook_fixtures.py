"""Fixtures of the tests that run real notebook kernels (the helpers they use live in
runtime_helpers.py); each folder whose tests need them imports them in its conftest.py.

* ``broker`` -- one ``gpushare broker --simulate h200`` subprocess per test module;
* ``gpu_broker`` -- one user-mode broker on the real GPUs (NVML inventory, real
  actuators) per test module, for the GPU tests;
* ``on_gpu_broker`` -- the module's GPU broker, with ``GPUSHARE_SOCKET`` set for the whole
  module (restored afterwards), for notebooks that find it without being told;
* ``on_broker`` -- the module's broker, with ``GPUSHARE_SOCKET`` set for the kernels the test
  starts (they inherit ``os.environ``; restored afterwards) and no lease left from before;
* ``extra_broker`` -- a factory for brokers with their own config, stopped after the test;
* ``kernels`` -- a factory of real ipykernel kernels, shut down after the test;
* ``fake_driver`` -- a folder holding a stand-in ``libcuda.so.1`` (``fake_libcuda.c``) for
  processes that preload the launch shim on a machine without a GPU.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from runtime_helpers import (
    BrokerProcess,
    NotebookKernel,
    dispose_broker,
    short_tempdir,
    start_broker_process,
    wait_for,
)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    """One broker on the simulated H200 for the whole test module."""
    running = start_broker_process()
    yield running
    dispose_broker(running)


@pytest.fixture(scope="module")
def gpu_broker() -> Iterator[BrokerProcess]:
    """One broker on the real GPUs for the whole test module."""
    running = BrokerProcess(short_tempdir("gps-gpu-"), simulate=None).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def on_gpu_broker(gpu_broker: BrokerProcess) -> Iterator[BrokerProcess]:
    """The module's GPU broker, named by ``GPUSHARE_SOCKET`` while the module runs: a
    module-scoped fixture that needs it (a notebook run once for the module) runs before
    any test's ``monkeypatch`` could set it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPUSHARE_SOCKET", str(gpu_broker.socket))
        yield gpu_broker


@pytest.fixture
def extra_broker() -> Iterator[Callable[..., BrokerProcess]]:
    """Factory for brokers with their own config (``sharing = "exclusive"`` ...)."""
    started: list[BrokerProcess] = []

    def start(config_toml: str | None = None, simulate: str = "h200") -> BrokerProcess:
        running = start_broker_process(config_toml, simulate)
        started.append(running)
        return running

    yield start
    for running in started:
        dispose_broker(running)


@pytest.fixture
def on_broker(broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> BrokerProcess:
    """Kernels started during the test (they inherit os.environ) talk to the module's broker.

    Also waits until no lease is left from an earlier test of the module.
    """
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    wait_for(lambda: not broker.leases(), "the module broker to have no leases left", 15)
    return broker


@pytest.fixture
def kernels() -> Iterator[Callable[..., list[NotebookKernel]]]:
    """Factory: ``a, b = kernels(2)`` starts kernels in parallel (optionally with ``env``)."""
    started: list[NotebookKernel] = []

    def start(count: int = 1, env: dict[str, str] | None = None) -> list[NotebookKernel]:
        fresh = [NotebookKernel(f"kernel-{len(started) + i}", env) for i in range(count)]
        started.extend(fresh)
        return [kernel.ready() for kernel in fresh]

    yield start
    for kernel in started:
        kernel.shutdown()


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory) -> Path:
    """A folder with a stand-in CUDA driver built from ``fake_libcuda.c`` (no GPU here)."""
    directory = tmp_path_factory.mktemp("fake-driver")
    source = Path(__file__).parent / "runtime" / "fake_libcuda.c"
    subprocess.run(
        ["cc", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
         "-o", str(directory / "libcuda.so.1"), str(source)],
        check=True,
    )  # fmt: skip
    return directory
