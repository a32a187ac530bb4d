"""A pytest plugin of the peer-suite harness (``benchmarks/peer_suites.py``).

``-p benchmarks.peer_plugin --peer-log FILE --peer-budget SECONDS``: each test's outcome
is appended to FILE as a JSON line the moment it is known (a run cut short keeps what
it had), and once SECONDS have passed the run stops cleanly after the test under way,
so the ways of a selection can be compared on the tests each reached.

It must not change how a test runs: it only reads reports.
"""

from __future__ import annotations

import json
import time
from typing import Any

_started = time.monotonic()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("gpushare peer suites")
    group.addoption("--peer-log", default=None, help="append each test's outcome here (JSON lines)")
    group.addoption("--peer-budget", type=float, default=None, help="stop after this many seconds")


def pytest_configure(config: Any) -> None:
    global _started
    _started = time.monotonic()


def _outcome(report: Any) -> str | None:
    """The test's outcome once this report settles it, else None."""
    if report.when == "setup":
        if report.skipped:
            return "skipped"
        return "error" if report.failed else None
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome  # passed, failed, skipped
    if report.when == "teardown" and report.failed:
        return "error"
    return None


def pytest_runtest_logreport(report: Any) -> None:
    outcome = _outcome(report)
    path = _config.getoption("peer_log") if _config is not None else None
    if outcome is None or not path:
        return
    entry = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 4)}
    if outcome in ("failed", "error"):
        # The exception's own lines ("E ...", else the last line), so that a difference
        # can be explained without the whole report.
        lines = [line for line in str(report.longreprtext).splitlines() if line.strip()]
        errors = [line[1:].strip() for line in lines if line.startswith("E ")]
        entry["why"] = (" | ".join(errors) or (lines[-1] if lines else ""))[:600]
    with open(path, "a") as log:
        log.write(json.dumps(entry) + "\n")


_config: Any = None


def pytest_sessionstart(session: Any) -> None:
    global _config
    _config = session.config


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    budget = _config.getoption("peer_budget") if _config is not None else None
    if budget is not None and time.monotonic() - _started > budget:
        _config._peer_session.shouldstop = f"the peer run's budget of {budget:g} s is spent"


def pytest_collection_finish(session: Any) -> None:
    session.config._peer_session = session
