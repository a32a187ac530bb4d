"""A benchmark ended by a signal stops what it started.

Benchmarks start brokers, tenants, notebook kernels, training jobs and worker processes,
and stop them in ``finally:`` blocks and context managers.  Python runs those when
Ctrl-C ends a run, but not when SIGTERM (``timeout``, a batch system) or SIGHUP (a
closed terminal) does: the process dies on the spot and its children live on -- a
broker, started in a session of its own, keeps its socket, its journal and its port.

Two helpers, used by every benchmark that starts a process:

* :func:`exit_on_signals` turns SIGTERM, SIGINT and SIGHUP into :class:`SystemExit`, so
  the same cleanup runs whatever ended the run.  The first one counts: while cleaning up,
  SIGTERM and SIGHUP sent again (``timeout`` signals the child and then its whole
  process group) are ignored, and a second Ctrl-C interrupts as usual.  A signal the
  caller chose to ignore (``nohup``, SIGINT in a background job) stays ignored.
* :func:`track` names a child to stop when this process ends, however it ends short of
  SIGKILL, if it still runs then: SIGTERM first, SIGKILL after a grace period.

:func:`run_to_end` runs a command to its end or its timeout, stopping it the same way
(a suite killed outright could not stop the broker it started).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # noqa: F401 - registers its exit hook now, before ours
import os
import signal
import subprocess
from typing import Any, TypeVar

STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 30.0  # for a child to stop after SIGTERM (a broker undoes its actuators)

Child = TypeVar("Child")
_tracked: list[Any] = []
_owner: int | None = None  # the process whose children _tracked lists


def exit_on_signals() -> None:
    """From now on, SIGTERM, SIGINT and SIGHUP raise SystemExit (128 + the signal)."""
    for signum in STOPPING_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _exit)


def _exit(signum: int, frame: object) -> None:
    for other in STOPPING_SIGNALS:
        if signal.getsignal(other) is _exit:
            again = signal.default_int_handler if other == signal.SIGINT else signal.SIG_IGN
            signal.signal(other, again)
    raise SystemExit(128 + signum)


def track(child: Child) -> Child:
    """Stop ``child`` (a ``subprocess.Popen``, a ``multiprocessing.Process`` or a
    :class:`~gpushare_ext.broker.edges.launch.BrokerProcess`) when this process exits, if it
    still runs then."""
    global _owner
    if _owner != os.getpid():  # the first child of this process (a fork starts afresh)
        _owner = os.getpid()
        _tracked.clear()
        atexit.register(_stop_tracked)
    _tracked.append(child)
    return child


def _stop_tracked() -> None:
    # Exit hooks run last registered first: this one runs before multiprocessing's (its
    # module, imported above, registered it), which joins its processes, and a worker
    # blocked on a queue nobody reads any more would never end.
    if _owner != os.getpid():
        return  # inherited by a fork: not its children
    while _tracked:
        with contextlib.suppress(Exception):  # stop the others whatever one does
            stop(_tracked.pop())


def stop(child: Any, grace: float = GRACE_S) -> None:
    """SIGTERM ``child`` if it runs, and SIGKILL it if it is still there after ``grace`` s."""
    if hasattr(child, "alive"):  # a BrokerProcess: its stop() kills after the timeout
        if child.alive():
            child.stop(timeout=grace)
        return
    if hasattr(child, "is_alive"):  # a multiprocessing.Process
        if child.is_alive():
            child.terminate()
            child.join(grace)
            if child.is_alive():
                child.kill()
                child.join()
        return
    if child.poll() is None:  # a subprocess.Popen
        child.terminate()
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def run_to_end(command: list[str], timeout: float, **popen: Any) -> int | None:
    """Run ``command`` until it ends (its exit status) or ``timeout`` seconds pass (then
    it is stopped, and the status is None)."""
    process = track(subprocess.Popen(command, **popen))
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        return None
