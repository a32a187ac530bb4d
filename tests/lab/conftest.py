"""Fixtures for the Jupyter-facing tests (server extension, widget, browser).

Brokers come from ``tests/conftest.py`` (``running_broker``, ``start_broker``): the real
``gpushare broker --simulate h200`` in a subprocess.  ``sessions`` opens broker
connections the way notebook kernels do; a connection's leases end when it closes.

pytest-jupyter (``jp_fetch``, ``jp_serverapp`` ...) is imported here rather than
registered for the whole suite: its autouse fixtures create a ServerApp and an event
loop around every test, which only the tests in this folder want.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F403 - fixtures and hooks, this folder only

from gpushare_ext.client import BrokerClient


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (Unix socket paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gps-lab-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sessions(running_broker) -> Iterator[Callable[[], BrokerClient]]:
    """Factory of broker connections to ``running_broker``, like notebook kernels'."""
    opened: list[BrokerClient] = []

    def connect() -> BrokerClient:
        opened.append(BrokerClient(running_broker.socket, client="kernel"))
        return opened[-1]

    yield connect
    for client in opened:
        with contextlib.suppress(Exception):
            client.close()


@pytest.fixture(autouse=True)
def kernel_environment_restored(monkeypatch):
    """The server extension sets LD_PRELOAD for the kernels its server starts; the servers
    here run inside the test process, so give the process its own environment back."""
    import os

    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    if not os.environ["LD_PRELOAD"]:
        monkeypatch.delenv("LD_PRELOAD")
