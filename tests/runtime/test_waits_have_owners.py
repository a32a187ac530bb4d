"""Every wait of a launch has an owner and a way out, and Ctrl-C always reaches the user.

A launch can wait in two places: held by the launch shim while the broker has the
session paused (C, before the launch reaches the driver), and inside a long kernel's
preemptible launch after a yield, until the broker resumes (Python, in the shim's hook).
Each waits only for the broker's word in the session's control block, so each must end
when the broker resumes, when the lease ends, when the broker goes away, when the session
closes, and on Ctrl-C (within a second, leaving the kernel usable for the next cell).

No GPU here: kernels preload the real launch shim in front of a stand-in CUDA driver
(``fake_libcuda.c``); brokers run on the simulated H200.  On a simulated GPU the session
does not attach the shim itself, so the cells point it at the session's control block as
``GpuSession._attach_interposer`` does on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_helpers import DRIVER_ENTRIES, holding_cell, short_tempdir, wait_for

from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.protocol import PreemptionLevel
from gpushare_ext.runtime import interpose
from gpushare_ext.runtime.paused import wait_until_resumed

YIELD = int(PreemptionLevel.YIELD)


class HostFlag:
    """A host stand-in for the device yield flag (read and set, as the runtime uses it)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def read(self) -> int:
        return self.value

    def set(self, value: int = 1) -> None:
        self.value = value


@pytest.fixture
def paused_block(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "s.cb")
    block.publish(gate_closed=False, state=LeaseState.PAUSED, level=YIELD)
    yield block
    block.close()


def _wait_in_thread(block_of, flag, interrupted=lambda: False) -> threading.Thread:
    thread = threading.Thread(
        target=wait_until_resumed, args=(block_of, flag, interrupted), daemon=True
    )
    thread.start()
    time.sleep(0.1)
    assert thread.is_alive(), "the wait ended although the broker still holds the session"
    return thread


def test_the_wait_after_a_yield_ends_when_the_lease_ends(paused_block):
    flag = HostFlag(1)
    thread = _wait_in_thread(lambda: paused_block, flag)
    paused_block.publish(gate_closed=False, state=None)  # the broker ended the lease
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert flag.value == 0  # nobody else would lower it now


def test_the_wait_after_a_yield_ends_when_the_session_closes(paused_block):
    thread = _wait_in_thread(lambda: paused_block, HostFlag(1))
    paused_block.close()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_the_wait_after_a_yield_ends_when_the_broker_goes_away(paused_block):
    thread = _wait_in_thread(lambda: paused_block, HostFlag(1))
    paused_block.release_locally("the broker went away")  # what the session does then
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_the_wait_after_a_yield_ends_on_ctrl_c(paused_block):
    pressed = threading.Event()
    thread = _wait_in_thread(lambda: paused_block, HostFlag(1), pressed.is_set)
    started = time.monotonic()
    pressed.set()
    thread.join(timeout=2)
    assert not thread.is_alive() and time.monotonic() - started < 0.1


def test_without_a_session_a_raised_flag_is_lowered_not_waited_for():
    from gpushare_ext.kernels.launch import LaunchHooks

    flag = HostFlag(1)
    started = time.monotonic()
    LaunchHooks().wait_for_resume(flag, lambda: False)
    assert flag.value == 0 and time.monotonic() - started < 0.1


def test_a_held_launch_ends_when_the_session_stops_following_the_block(tmp_path):
    """The session closed (or never had a block): the shim holds nobody."""
    block = ControlBlock.create(tmp_path / "s.cb")
    block.publish(gate_closed=True, state=LeaseState.PAUSED)
    interpose.use_driver(None)
    interpose.point_at(block.address())
    library = interpose.native_library()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(library.gps_launch_enter(None, 0)))
    thread.start()
    try:
        time.sleep(0.1)
        assert thread.is_alive()
        interpose.point_at(None)
        thread.join(timeout=2)
        assert not thread.is_alive() and result == [1]
    finally:
        interpose.point_at(None)
        block.close()


def test_ctrl_c_ends_a_held_launch_after_python_put_its_own_handler_back(tmp_path):
    """ipykernel installs Python's SIGINT handler at every cell, over the shim's: the hold
    must chain its handler in again, or Ctrl-C could not end it."""
    block = ControlBlock.create(tmp_path / "s.cb")
    interpose.use_driver(None)
    interpose.point_at(block.address())  # the shim's handler goes in here
    seen: list[str] = []
    previous = signal.signal(signal.SIGINT, lambda *_: seen.append("python"))  # as ipykernel
    library = interpose.native_library()
    result: list[int] = []
    try:
        block.publish(gate_closed=True, state=LeaseState.PAUSED)
        thread = threading.Thread(target=lambda: result.append(library.gps_launch_enter(None, 0)))
        thread.start()
        time.sleep(0.1)
        assert thread.is_alive()
        signal.raise_signal(signal.SIGINT)
        thread.join(timeout=1)
        assert not thread.is_alive(), "Ctrl-C did not end the hold"
        time.sleep(0.05)
        assert seen == ["python"]  # and Python still heard it
    finally:
        signal.signal(signal.SIGINT, previous)
        block.publish(gate_closed=False, state=LeaseState.RUNNING)
        interpose.point_at(None)
        block.close()


# ------------------------------------------------------------------ in real notebook kernels

FAKE_DRIVER_CELL = (
    DRIVER_ENTRIES
    + r"""
import os, time
from gpushare_ext.runtime import interpose
_p, _u, _cuda, _entry = p, u, cuda, entry
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _p, _u, _u, _u, _u, _u, _u, _u, _p, _p, _p)
_launch = _entry(b"cuLaunchKernel", _LAUNCH)  # the shim's wrapper, as CUDA's runtime gets it
def one_launch(function=None, params=None):
    return _launch(function, 1, 1, 1, 1, 1, 1, 0, None, params, None)
"""
)


def _shim_env(fake_driver: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LD_PRELOAD=str(interpose.NATIVE), LD_LIBRARY_PATH=str(fake_driver), **extra)
    env.pop("GPUSHARE_INTERPOSER", None)
    return env


def _low_cell(stop_file: Path) -> str:
    """A low-priority cell that launches until ``stop_file`` exists and says how long any
    launch was held; on Ctrl-C it notes when the interrupt reached Python."""
    return (
        "%%gpu priority=low\n"
        "from gpushare_ext.runtime.session import current_session\n"
        "interpose.point_at(current_session().control_block.address())\n"
        "print('launching', flush=True)\n"
        "try:\n"
        f"    while not os.path.exists({str(stop_file)!r}):\n"
        "        started = time.monotonic()\n"
        "        one_launch()\n"
        "        if time.monotonic() - started > 0.2:\n"
        "            print(f'held for {time.monotonic() - started:.1f} s', flush=True)\n"
        "        time.sleep(0.005)\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted at {time.time()!r}', flush=True)\n"
        "    raise\n"
    )


def _paused(broker, pid: int) -> bool:
    return any(lease.state == "paused" for lease in broker.leases_of(pid))


@contextlib.contextmanager
def _paused_by_a_high_cell(broker, kernels, env: dict[str, str], low_cell_of) -> Iterator:
    """Two kernels: the low one runs ``low_cell_of(stop_file)`` (which prints "launching"
    first) until the high one's lease pauses it; yields (the low kernel, its running
    cell).  Both cells are let go afterwards."""
    low, high = kernels(2, env=env)
    low.run("%load_ext gpushare_ext\n" + FAKE_DRIVER_CELL).ok()
    high.run("%load_ext gpushare_ext").ok()
    scratch = short_tempdir()
    running = low.submit(low_cell_of(scratch / "stop"))
    running.wait_shown("launching")
    holder = high.submit(holding_cell(scratch / "release", "high"))
    try:
        holder.wait_shown("holding since")
        wait_for(lambda: _paused(broker, low.pid), "the low cell to be paused")
        time.sleep(0.3)  # the low kernel's next step is now held
        yield low, running
    finally:
        (scratch / "release").touch()
        (scratch / "stop").touch()
        holder.wait()


def test_ctrl_c_during_a_launch_held_for_another_users_cell_returns_at_once(
    on_broker, kernels, fake_driver
):
    with _paused_by_a_high_cell(on_broker, kernels, _shim_env(fake_driver), _low_cell) as (
        low,
        held,
    ):
        interrupted_at = time.time()
        low.interrupt()
        held.wait(timeout=30)
        assert held.error is not None and held.error["ename"] == "KeyboardInterrupt", (
            held.describe()
        )
        reached = float(held.stdout_value("interrupted at") or "nan")
        assert reached - interrupted_at < 1.0, held.describe()
        # The kernel is usable at once: its lease ended with the cell, so nothing holds it.
        after = low.run("print(one_launch())", timeout=10).ok()
        assert after.final_text().strip() == "0"


def test_a_launch_held_when_the_broker_dies_goes_on(extra_broker, kernels, fake_driver):
    broker = extra_broker()
    env = _shim_env(fake_driver, GPUSHARE_SOCKET=str(broker.socket))
    with _paused_by_a_high_cell(broker, kernels, env, _low_cell) as (_, held):
        broker.stop(signal.SIGKILL)
        held.wait_shown("held for", timeout=20)  # the held launch went on
    held.wait(timeout=30)
    assert held.error is None, held.describe()


def _locked_cell(stop_file: Path) -> str:
    """A low-priority cell whose main thread sits in a CUDA call that blocks while the
    control block says paused, as a process the broker locked does."""
    return (
        "%%gpu priority=low\n"
        "from gpushare_ext.control_block import STATE_OFFSET\n"
        "from gpushare_ext.runtime.session import current_session\n"
        "address = current_session().control_block.address()\n"
        "interpose.point_at(address)\n"
        "_cuda.fake_lock_follows(ctypes.c_void_p(address + STATE_OFFSET))\n"
        "print('launching', flush=True)\n"
        "try:\n"
        f"    while not os.path.exists({str(stop_file)!r}):\n"
        "        _cuda.cuCtxSynchronize()  # blocks while the process is 'locked'\n"
        "        time.sleep(0.005)\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted at {time.time()!r}', flush=True)\n"
        "    raise\n"
    )


def test_ctrl_c_while_locked_and_blocked_in_a_cuda_call_returns_at_once(
    on_broker, kernels, fake_driver
):
    """At the lock level every CUDA call of the process blocks until the broker lets go,
    so Python's own handler never runs: the session's pause watch sees the Ctrl-C through
    the shim's handler, gives up the lease, and the call returns."""
    env = _shim_env(fake_driver)
    with _paused_by_a_high_cell(on_broker, kernels, env, _locked_cell) as (low, blocked):
        (lease,) = on_broker.leases_of(low.pid)
        # The lock was asked (status names the gate that holds a simulated GPU's session,
        # and says the lock was asked in its reason).
        assert lease.preemption_level == 0 and "gated, not locked" in lease.reason, lease
        interrupted_at = time.time()
        low.interrupt()
        blocked.wait(timeout=30)
        assert blocked.error is not None and blocked.error["ename"] == "KeyboardInterrupt"
        reached = float(blocked.stdout_value("interrupted at") or "nan")
        assert reached - interrupted_at < 1.0, blocked.describe()
        assert "the lease is given up" in blocked.shown_text(), blocked.describe()
        assert not on_broker.leases_of(low.pid)


PREEMPTIBLE_CELL = r"""
import tempfile, types
from pathlib import Path
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.kernels import launch as transactions
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.runtime import preemptible
from gpushare_ext.runtime.paused import wait_until_resumed

registry = preemptible.installed()
_LOAD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_p), ctypes.c_char_p)
_GETF = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_p), _p, ctypes.c_char_p)
module, function = _p(), _p()
_entry(b"cuModuleLoadData", _LOAD)(ctypes.byref(module), b"//\n.version 8.0\n.target sm_90\n")
_entry(b"cuModuleGetFunction", _GETF)(ctypes.byref(function), module, b"long_kernel")
_cuda.fake_set_elapsed_ms.argtypes = [ctypes.c_float]
_cuda.fake_set_elapsed_ms(5.0)
one_launch(function)             # its first launch is timed: 5 ms, a long kernel
_cuda.fake_gpu_catch_up()
twin = registry.twins[function.value]
twin.ptx, twin.kernel = b"", object()  # no GPU to analyse it on: a stand-in twin

block = ControlBlock.create(Path(tempfile.mkdtemp()) / "lease.cb")
block.publish(gate_closed=False, state=LeaseState.RUNNING)  # a lease, as the broker writes it
interpose.point_at(block.address())
transactions.set_session_hooks(transactions.LaunchHooks(
    wait_for_resume=lambda flag, interrupted: wait_until_resumed(lambda: block, flag, interrupted)))

def transaction_stand_in(kernel, grid, blk, shared, stream, params, *, interrupted, longest_us):
    # No GPU: the part of a transaction that waits.  It yielded; the session waits for
    # the broker's resume with the real hook, exactly as a launch does after a yield.
    flag = types.SimpleNamespace(value=1, read=lambda: 1, set=lambda v=1: None)
    transactions.session_hooks().wait_for_resume(flag, interrupted)
    return types.SimpleNamespace(
        yields=1, aborts=0, saves=0, interrupted="rolled back" if interrupted() else "")

preemptible.run_launch = transaction_stand_in
params = (_p * 1)(ctypes.addressof(ctypes.c_int(7)))
print("in a lease:", one_launch(function, params), registry.launched, flush=True)
"""


def test_ctrl_c_during_a_preemptible_launch_waiting_for_resume(kernels, fake_driver):
    """The reported failure: Ctrl-C while a long kernel's launch waits in the shim's hook
    raised KeyboardInterrupt inside the ctypes callback, C got an undefined result
    (``OverflowError: value too large to convert to CUresult``) and the kernel hung."""
    (kernel,) = kernels(1, env=_shim_env(fake_driver))
    kernel.run("%load_ext gpushare_ext\n" + FAKE_DRIVER_CELL).ok()
    setup = kernel.run(PREEMPTIBLE_CELL).ok()
    assert "in a lease: 0 1" in setup.final_text(), setup.describe()
    waiting = kernel.submit(
        "block.publish(gate_closed=False, state=LeaseState.PAUSED, level=1)\n"
        "print('launching', flush=True)\n"
        "try:\n"
        "    one_launch(function, params)\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted at {time.time()!r}', flush=True)\n"
        "    raise\n"
    )
    waiting.wait_shown("launching")
    time.sleep(0.3)
    interrupted_at = time.time()
    kernel.interrupt()
    waiting.wait(timeout=20)
    assert waiting.error is not None and waiting.error["ename"] == "KeyboardInterrupt"
    text = waiting.shown_text()
    assert float(waiting.stdout_value("interrupted at") or "nan") - interrupted_at < 1.0
    # Raised once the hook had returned (in the cell's frame, not inside the callback),
    # and nothing crossed into C.
    frames = waiting.error["traceback"]
    assert "one_launch(function, params)" in frames, frames
    internals = ("preemptible.py", "session.py", "holds.py", "paused.py")
    assert not any(name in frames for name in internals), frames
    assert "Exception ignored" not in waiting.stderr and "OverflowError" not in text
    after = kernel.run(
        "block.publish(gate_closed=False, state=LeaseState.RUNNING)\n"
        "print(one_launch(function, params), registry.launched, registry.interrupted)",
        timeout=10,
    ).ok()
    assert after.final_text().strip() == "0 3 1", after.describe()
