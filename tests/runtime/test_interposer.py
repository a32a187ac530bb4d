"""The native launch interposer without a GPU: the install built it, it holds a launch
while the control block says paused, lets it go on resume or Ctrl-C, gives up the GIL
while it waits, and bounds the launches in flight (driven with a fake driver table).

On a GPU host, tests/runtime/test_interposer_gpu.py attaches it to real CUPTI callbacks.
"""

from __future__ import annotations

import ctypes
import io
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import DRIVER_ENTRIES, preloaded_env

from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.runtime import interpose

NOT_READY = 600
CONTEXT = ctypes.c_void_p(0x5EED)


@pytest.fixture
def block(tmp_path):
    control = ControlBlock.create(tmp_path / "session.cb")
    control.publish(gate_closed=False, state=LeaseState.RUNNING)
    interpose.use_driver(None)
    interpose.point_at(control.address())
    yield control
    interpose.point_at(None)
    control.close()


def test_the_install_built_the_native_interposer():
    assert interpose.NATIVE.exists(), "pip install should have compiled launch_interpose.c"
    library = interpose.native_library()
    assert library.gps_attached() == 0  # nothing attaches until a session asks


def _enter_in_thread(enter) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(enter(None, 0)), daemon=True)
    thread.start()
    return thread, result


def test_a_launch_waits_while_paused_and_goes_on_resume(block):
    library = interpose.native_library()
    assert library.gps_launch_enter(None, 0) == 0  # running: straight through

    block.publish(gate_closed=False, state=LeaseState.PAUSED, level=3)
    thread, result = _enter_in_thread(library.gps_launch_enter)
    time.sleep(0.3)
    assert thread.is_alive(), "the launch went through although the session is paused"

    block.publish(gate_closed=False, state=LeaseState.RUNNING)
    thread.join(timeout=2)
    assert not thread.is_alive() and result == [1]
    stats = interpose.stats()
    assert stats["held"] == 1 and stats["launches"] == 2
    assert stats["held_ns"] >= 0.3e9


def test_a_closed_gate_and_an_eviction_hold_launches_too(block):
    library = interpose.native_library()
    for how in (
        dict(gate_closed=True, state=LeaseState.PAUSED),
        dict(gate_closed=False, state=LeaseState.EVICTED),
    ):
        block.publish(**how)
        thread, _ = _enter_in_thread(library.gps_launch_enter)
        time.sleep(0.1)
        assert thread.is_alive(), how
        block.publish(gate_closed=False, state=LeaseState.RUNNING)
        thread.join(timeout=2)
        assert not thread.is_alive()


def test_a_held_launch_gives_up_the_gil_so_the_session_can_hear_the_broker(block):
    # PyDLL keeps the GIL across the call, as CuPy's launches do; the interposer must let
    # the session's other threads (the broker listener) run meanwhile.
    held_with_gil = ctypes.PyDLL(str(interpose.NATIVE)).gps_launch_enter
    held_with_gil.argtypes = [ctypes.c_void_p, ctypes.c_int]
    block.publish(gate_closed=False, state=LeaseState.PAUSED)
    ticks = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    holder, _ = _enter_in_thread(held_with_gil)
    time.sleep(0.05)
    counter = threading.Thread(target=ticker, daemon=True)
    counter.start()
    time.sleep(0.3)
    progressed = len(ticks)
    block.publish(gate_closed=False, state=LeaseState.RUNNING)
    holder.join(timeout=2)
    stop.set()
    counter.join(timeout=2)
    assert progressed >= 10, f"other Python threads ran {progressed} times in 0.3 s"


def test_ctrl_c_lets_a_held_launch_go_and_still_reaches_python(block, tmp_path):
    library = interpose.native_library()
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *_: seen.append("SIGINT"))
    try:
        interpose.point_at(block.address())  # wraps the handler now in place
        block.publish(gate_closed=False, state=LeaseState.PAUSED)
        thread, result = _enter_in_thread(library.gps_launch_enter)
        time.sleep(0.1)
        assert thread.is_alive()
        signal.raise_signal(signal.SIGINT)
        thread.join(timeout=2)
        assert not thread.is_alive() and result == [1]
        assert interpose.stats()["interrupted"] == 1
        time.sleep(0.05)  # Python runs its handler between bytecodes of this thread
        assert seen == ["SIGINT"]
    finally:
        signal.signal(signal.SIGINT, previous)
        block.publish(gate_closed=False, state=LeaseState.RUNNING)


class FakeGpu:
    """A driver table whose events complete when the test says the GPU got there."""

    def __init__(self) -> None:
        self.next_event = 1
        self.done: set[int] = set()
        self.outstanding: list[int] = []
        self.most_outstanding = 0
        self.synchronized: list[int] = []
        self.capturing = False
        self.gpu_ms_between_events = 0.0
        self.table = interpose.DriverTable(
            event_create=interpose.EVENT_CREATE(self._create),
            event_record=interpose.EVENT_RECORD(self._record),
            event_query=interpose.EVENT_OP(self._query),
            event_synchronize=interpose.EVENT_OP(self._synchronize),
            event_destroy=interpose.EVENT_OP(lambda event: 0),
            stream_is_capturing=interpose.IS_CAPTURING(self._is_capturing),
            event_elapsed=interpose.ELAPSED(self._elapsed),
        )

    def _create(self, out, flags) -> int:
        out[0] = self.next_event
        self.next_event += 1
        return 0

    def _record(self, event, stream) -> int:
        self.done.discard(event)
        self.outstanding.append(event)
        self.most_outstanding = max(self.most_outstanding, len(self.outstanding))
        return 0

    def _query(self, event) -> int:
        return 0 if event in self.done else NOT_READY

    def _synchronize(self, event) -> int:
        self.synchronized.append(event)
        self.gpu_reaches(event)
        return 0

    def _elapsed(self, out, start, end) -> int:
        out[0] = self.gpu_ms_between_events
        return 0

    def _is_capturing(self, stream, status) -> int:
        status[0] = 1 if self.capturing else 0
        return 0

    def gpu_reaches(self, event: int) -> None:
        while self.outstanding:
            first = self.outstanding.pop(0)
            self.done.add(first)
            if first == event:
                break


@pytest.fixture
def fake_gpu():
    gpu = FakeGpu()
    interpose.use_driver(gpu.table)
    interpose.native_library().gps_set_window(2, 4)
    yield gpu
    interpose.use_driver(None)
    interpose.native_library().gps_set_window(0, interpose.DEFAULT_RECORD_EVERY)


def test_at_most_a_window_of_checkpoints_stays_in_flight(fake_gpu):
    library = interpose.native_library()
    waits = [library.gps_launch_exit(CONTEXT, None, 0) for _ in range(8)]
    assert waits == [0] * 8  # two checkpoints, one every four launches: within the window
    assert len(fake_gpu.outstanding) == 2 and fake_gpu.synchronized == []

    waits = [library.gps_launch_exit(CONTEXT, None, 0) for _ in range(4)]

    assert waits == [0, 0, 0, 1]  # the third checkpoint waits for the oldest
    assert len(fake_gpu.synchronized) == 1
    assert fake_gpu.most_outstanding == 2
    assert interpose.stats()["window_waits"] == 1


def test_checkpoints_the_gpu_already_passed_cost_no_wait(fake_gpu):
    library = interpose.native_library()
    for _ in range(8):
        library.gps_launch_exit(CONTEXT, None, 0)
    fake_gpu.gpu_reaches(fake_gpu.outstanding[-1])  # the GPU caught up on its own

    assert [library.gps_launch_exit(CONTEXT, None, 0) for _ in range(8)] == [0] * 8
    assert fake_gpu.synchronized == []


def test_launches_into_a_stream_being_captured_are_not_bounded(fake_gpu):
    library = interpose.native_library()
    fake_gpu.capturing = True
    assert [library.gps_launch_exit(CONTEXT, None, 0) for _ in range(40)] == [0] * 40
    assert fake_gpu.outstanding == [] and interpose.stats()["captured"] == 10


def test_a_window_of_zero_turns_the_bound_off(fake_gpu):
    library = interpose.native_library()
    library.gps_set_window(0, 4)
    assert [library.gps_launch_exit(CONTEXT, None, 0) for _ in range(40)] == [0] * 40
    assert fake_gpu.outstanding == []


def _busy_stretch(library, fake_gpu) -> None:
    """Four rounds of four launches with the GPU kept busy (the newest checkpoint still
    ahead of it), then one more launch, at which the bound is worked out again."""
    for _ in range(4):
        for _ in range(4):
            library.gps_launch_exit(CONTEXT, None, 0)
        if len(fake_gpu.outstanding) > 1:
            fake_gpu.gpu_reaches(fake_gpu.outstanding[-2])
    library.gps_launch_exit(CONTEXT, None, 0)


@pytest.mark.parametrize(
    ("ms_between_events", "window", "every"),
    [
        pytest.param(10.0, 2, 1, id="long kernels: one checkpoint each, two in flight"),
        pytest.param(0.1, 4, 30, id="short kernels: ~3 ms of them in flight"),
    ],
)
def test_the_bound_follows_the_gpu_time_a_launch_takes(fake_gpu, ms_between_events, window, every):
    library = interpose.native_library()
    library.gps_set_target(3000, 0)  # keep about 3 ms of GPU work queued
    fake_gpu.gpu_ms_between_events = ms_between_events  # for the 4 launches between events
    _busy_stretch(library, fake_gpu)

    stats = interpose.stats()
    assert stats["per_launch_ns"] == pytest.approx(ms_between_events / 4 * 1e6, rel=0.01)
    assert (stats["window"], stats["record_every"]) == (window, every)


@pytest.mark.parametrize(
    ("ms_between_events", "window", "every"),
    [
        pytest.param(10.0, 1, 1, id="long kernels: one behind the running one"),
        pytest.param(0.1, 4, 10, id="short kernels: ~1 ms of them in flight"),
    ],
)
def test_while_a_rival_exists_the_tighter_bound_holds(
    fake_gpu, tmp_path, ms_between_events, window, every
):
    library = interpose.native_library()
    library.gps_set_target(3000, 1000)
    block = ControlBlock.create(tmp_path / "session.cb")
    block.publish(gate_closed=False, state=LeaseState.RUNNING)
    block.set_unrivalled(False)  # a session that could preempt this one exists
    interpose.point_at(block.address())
    try:
        fake_gpu.gpu_ms_between_events = ms_between_events
        _busy_stretch(library, fake_gpu)
        assert (interpose.stats()["window"], interpose.stats()["record_every"]) == (window, every)

        block.set_unrivalled(True)  # the rival left: the usual ~3 ms again
        library.gps_launch_exit(CONTEXT, None, 0)
        for _ in range(8):
            library.gps_launch_exit(CONTEXT, None, 0)
        assert interpose.stats()["window"] >= 2
    finally:
        interpose.point_at(None)
        block.close()


def test_a_hold_notes_the_work_the_shim_believes_is_queued(fake_gpu, tmp_path):
    """A pause's lock waits for the queued work: the shim says how much it thought there
    was when a hold began, so a slow stop can be told apart from a queue left to grow."""
    library = interpose.native_library()
    library.gps_set_target(3000, 0)
    fake_gpu.gpu_ms_between_events = 0.1
    _busy_stretch(library, fake_gpu)  # learns 25 µs per launch; some events still ahead
    stats = interpose.stats()
    assert stats["hold_queued_us_first"] == 0  # no hold yet
    every = stats["record_every"]
    outstanding = len(fake_gpu.outstanding)
    assert outstanding >= 1

    block = ControlBlock.create(tmp_path / "session.cb")
    block.publish(gate_closed=False, state=LeaseState.PAUSED, level=3)
    interpose.point_at(block.address())
    try:
        thread, result = _enter_in_thread(library.gps_launch_enter)
        time.sleep(0.2)
        block.publish(gate_closed=False, state=LeaseState.RUNNING)
        thread.join(timeout=2)
        assert result == [1]
    finally:
        interpose.point_at(None)
        block.close()
    stats = interpose.stats()
    launches = stats["hold_queued_launches_max"]
    # Events the GPU passed count until the shim has seen them pass: at least those still
    # ahead, at most a full window, plus the launches since the last event.
    assert outstanding * every <= launches < (stats["window"] + 1) * every
    assert stats["hold_queued_us_first"] == stats["hold_queued_us_max"]
    assert stats["hold_queued_us_max"] == pytest.approx(launches * 25, abs=1)


def test_time_the_gpu_sat_idle_between_checkpoints_is_not_taken_for_launch_time(fake_gpu):
    library = interpose.native_library()
    library.gps_set_target(3000, 0)
    fake_gpu.gpu_ms_between_events = 50.0  # mostly the host's think time, not GPU work
    for _ in range(4):
        for _ in range(4):
            library.gps_launch_exit(CONTEXT, None, 0)
        fake_gpu.gpu_reaches(fake_gpu.outstanding[-1])  # idle before the next launches
    library.gps_launch_exit(CONTEXT, None, 0)

    stats = interpose.stats()
    assert stats["per_launch_ns"] == 0  # not learnt from idle intervals
    assert (stats["window"], stats["record_every"]) == (2, 4)  # the fixed start

    fake_gpu.gpu_ms_between_events = 0.1  # then a busy stretch teaches the real figure
    _busy_stretch(library, fake_gpu)
    assert interpose.stats()["per_launch_ns"] == pytest.approx(25_000, rel=0.01)


def test_a_kernel_started_without_the_shim_is_told_how_to_get_it(monkeypatch):
    monkeypatch.delenv("GPUSHARE_INTERPOSER", raising=False)
    with pytest.raises(interpose.InterposerError) as raised:
        interpose.attach(0)
    message = str(raised.value)
    assert "\n" not in message
    assert "started without the launch shim" in message and str(interpose.NATIVE) in message


def test_a_bad_interposer_setting_is_named(monkeypatch):
    monkeypatch.setenv("GPUSHARE_INTERPOSER", "sometimes")
    with pytest.raises(interpose.InterposerError) as raised:
        interpose.attach(0)
    assert str(raised.value) == "GPUSHARE_INTERPOSER='sometimes' is not one of auto, cupti, off"


def test_without_a_gpu_the_cupti_way_says_why_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSHARE_INTERPOSER", "cupti")
    monkeypatch.setenv("GPUSHARE_CUPTI", str(tmp_path / "libcupti.so.13"))
    library = interpose.native_library()
    message = ctypes.create_string_buffer(512)
    code = library.gps_attach(str(tmp_path / "libcupti.so.13").encode(), message, len(message))
    text = message.value.decode()
    assert code in (-1, -2), text  # no driver here, or (on a GPU host) no such CUPTI file
    assert "\n" not in text and text
    with pytest.raises(interpose.InterposerError) as raised:
        interpose.attach(0)
    assert str(raised.value) == text


# ------------------------------------------------------------------ preloaded, on a fake driver

SHIM_SCRIPT = r"""
import ctypes, json, sys, threading, time
from pathlib import Path
from gpushare_ext.runtime import interpose
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState

u, p = ctypes.c_uint, ctypes.c_void_p
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p)
cuda = ctypes.CDLL("libcuda.so.1")  # a program (CUDA's runtime) finding the driver
cuda.fake_real_launch.restype = p
for name in ("fake_launches", "fake_records"):
    getattr(cuda, name).restype = ctypes.c_ulong
get_proc = cuda.cuGetProcAddress_v2  # looked up through dlsym, as cudart does
get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(p), ctypes.c_int, ctypes.c_uint64, p]
found = p()
get_proc(b"cuLaunchKernel", ctypes.byref(found), 12080, 0, None)
again = p()
get_proc(b"cuGetProcAddress", ctypes.byref(again), 12080, 0, None)
launch = LAUNCH(found.value)
out = {
    "preloaded": interpose.native_library().gps_preloaded(),
    "launch_wrapped": found.value != cuda.fake_real_launch(),
    "lookup_wrapped": again.value == ctypes.cast(get_proc, p).value,
}
launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
out["passthrough_launches"] = cuda.fake_launches()
block = ControlBlock.create(Path(sys.argv[1]) / "session.cb")
block.publish(gate_closed=False, state=LeaseState.RUNNING)
out["how"] = interpose.attach(block.address()).describe()
block.publish(gate_closed=False, state=LeaseState.PAUSED, level=3)
held = threading.Thread(target=launch, args=(None, 1, 1, 1, 1, 1, 1, 0, None, None, None))
held.start()
time.sleep(0.3)
out["launches_while_paused"] = cuda.fake_launches() - out["passthrough_launches"]
out["held_thread_alive"] = held.is_alive()
block.publish(gate_closed=False, state=LeaseState.RUNNING)
held.join(timeout=5)
out["launches_after_resume"] = cuda.fake_launches() - out["passthrough_launches"]
for _ in range(40):
    launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
out["checkpoints_recorded"] = cuda.fake_records()
out["stats"] = interpose.stats()
print(json.dumps(out))
"""


UNLOAD_SCRIPT = (
    DRIVER_ENTRIES
    + r"""
import json, sys, threading, time
from pathlib import Path
from gpushare_ext.runtime import interpose
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState

for name in ("fake_launches", "fake_unloads", "fake_launches_at_unload"):
    getattr(cuda, name).restype = ctypes.c_ulong
launch = entry(b"cuLaunchKernel", ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p))
unload = entry(b"cuModuleUnload", ctypes.CFUNCTYPE(ctypes.c_int, p))
block = ControlBlock.create(Path(sys.argv[1]) / "session.cb")
block.publish(gate_closed=False, state=LeaseState.RUNNING)
interpose.attach(block.address())
block.publish(gate_closed=False, state=LeaseState.PAUSED, level=0)
held = threading.Thread(target=launch, args=(p(0x1234), 1, 1, 1, 1, 1, 1, 0, None, None, None))
held.start()
time.sleep(0.2)
unloader = threading.Thread(target=unload, args=(p(0x12),))
unloader.start()
time.sleep(0.3)
out = {"unloads_while_held": cuda.fake_unloads(), "unloader_waits": unloader.is_alive()}
block.publish(gate_closed=False, state=LeaseState.RUNNING)
held.join(5)
unloader.join(5)
out["unloads"] = cuda.fake_unloads()
out["launches_before_the_unload"] = cuda.fake_launches_at_unload()
out["alone"] = unload(p(0x13)) == 0  # no launch in hand: at once
print(json.dumps(out))
"""
)


def test_a_module_is_unloaded_only_after_a_launch_held_in_another_thread_went_on(
    fake_driver, tmp_path
):
    out = run_preloaded(UNLOAD_SCRIPT, fake_driver, str(tmp_path))
    # While the launch is held (the session paused), the unload waits: launching a
    # function of a module already unloaded would be undefined.
    assert out["unloads_while_held"] == 0 and out["unloader_waits"], out
    # Resumed: the launch reaches the driver first, then the module goes.
    assert out["unloads"] == 1 and out["launches_before_the_unload"] == 1, out
    assert out["alone"]


UNLEASED_SCRIPT = (
    DRIVER_ENTRIES
    + r"""
import json, sys
from pathlib import Path
from gpushare_ext.runtime import interpose, preemptible
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState

launch = entry(b"cuLaunchKernel", ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p))
def launches(n):
    for _ in range(n):
        assert launch(p(0x1234), 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
    return interpose.stats()["window_waits"]

assert preemptible.install() is not None  # what %load_ext does: the driver is now in use
out = {"unleased": launches(100)}
block = ControlBlock.create(Path(sys.argv[1]) / "session.cb")
block.publish(gate_closed=False, state=LeaseState.RUNNING)
interpose.attach(block.address())  # a low lease: someone may pause it
out["leased"] = launches(100) - out["unleased"]
interpose.bound(False)  # the lease ended
out["after"] = launches(100) - out["leased"] - out["unleased"]
print(json.dumps(out))
"""
)


def test_launches_outside_a_lease_are_not_kept_waiting(fake_driver, tmp_path):
    out = run_preloaded(UNLEASED_SCRIPT, fake_driver, str(tmp_path))
    # The stand-in GPU never finishes an event on its own, so a bounded queue makes every
    # few launches wait for the oldest: that is what a lease gets, and only a lease.
    assert out["leased"] > 0, out
    assert out["unleased"] == 0 and out["after"] == 0, out


LOCKED_SCRIPT = (
    DRIVER_ENTRIES
    + r"""
import json, sys, threading, time
from pathlib import Path
from gpushare_ext.runtime import interpose
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState

cuda.fake_calls_waiting.restype = ctypes.c_ulong
launch = entry(b"cuLaunchKernel", ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p))
block = ControlBlock.create(Path(sys.argv[1]) / "session.cb")
block.publish(gate_closed=False, state=LeaseState.RUNNING)
interpose.attach(block.address())
stop = threading.Event()

def launching():
    while not stop.is_set():
        launch(p(0x1234), 1, 1, 1, 1, 1, 1, 0, None, None, None)

cuda.fake_lock_process(1)  # the broker's checkpoint lock: driver calls wait
launcher = threading.Thread(target=launching, daemon=True)
launcher.start()
deadline = time.monotonic() + 10
while cuda.fake_calls_waiting() == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
out = {"launcher_waits_in_the_driver": cuda.fake_calls_waiting() > 0}
# What the thread that lets a Ctrl-C through does once it gave the lease up.
unbound = threading.Thread(target=lambda: (interpose.bound(False), interpose.bound(True)))
unbound.start()
unbound.join(2)
out["unbound_returned"] = not unbound.is_alive()
cuda.fake_lock_process(0)
stop.set()
launcher.join(5)
unbound.join(5)
print(json.dumps(out))
"""
)


def test_the_bound_changes_while_a_launch_waits_in_a_locked_driver(fake_driver, tmp_path):
    out = run_preloaded(LOCKED_SCRIPT, fake_driver, str(tmp_path))
    # A launching thread waits inside a driver call of the shim's (the process is locked);
    # setting the bound from another thread must not wait for it, or a Ctrl-C that gives
    # the lease up could never reach the broker, and the lock would never end.
    assert out == {"launcher_waits_in_the_driver": True, "unbound_returned": True}, out


def run_preloaded(script: str, fake_driver: Path, *args: str) -> dict:
    """Run ``script`` in a fresh interpreter with the shim preloaded in front of the fake
    driver (as a kernel the server extension starts); its last line of output, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=preloaded_env(fake_driver),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_preloaded_the_shim_wraps_what_the_driver_hands_out_and_holds_it(fake_driver, tmp_path):
    seen = run_preloaded(SHIM_SCRIPT, fake_driver, str(tmp_path))

    assert seen["preloaded"] == 1
    assert seen["launch_wrapped"] and seen["lookup_wrapped"]
    assert seen["passthrough_launches"] == 1  # not attached yet: a plain pass-through
    assert seen["how"].startswith("launches held on the host while paused (launch shim)")
    assert seen["launches_while_paused"] == 0 and seen["held_thread_alive"]
    assert seen["launches_after_resume"] == 1
    assert seen["checkpoints_recorded"] > 0  # the bound on work in flight is at work
    assert seen["stats"]["held"] == 1


# ------------------------------------------------------------------ kernels loaded from PTX

PTX_SCRIPT = (
    DRIVER_ENTRIES
    + r"""
import ctypes, json, os, signal, sys, time
from pathlib import Path
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.runtime import interpose

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p)
LOAD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(p), ctypes.c_char_p)
GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(p), p, ctypes.c_char_p)
UNLOAD = ctypes.CFUNCTYPE(ctypes.c_int, p)
cuda.fake_launches.restype = ctypes.c_ulong
cuda.fake_set_elapsed_ms.argtypes = [ctypes.c_float]

load, get, unload = entry(b"cuModuleLoadData", LOAD), entry(b"cuModuleGetFunction", GET), entry(b"cuModuleUnload", UNLOAD)
launch = entry(b"cuLaunchKernel", LAUNCH)
library = interpose.native_library()
message = ctypes.create_string_buffer(256)
assert library.gps_activate_preload(message, 256) == 0, message.value
block = ControlBlock.create(Path(sys.argv[1]) / "session.cb")
block.publish(gate_closed=False, state=None)  # a session, no lease yet
interpose.point_at(block.address())

seen = {"modules": [], "functions": [], "unloads": [], "launches": []}
how = {"answer": 0, "interrupt": False, "fail": False}

def on_module(module, image):
    seen["modules"].append(ctypes.string_at(image)[:12].decode())
def on_function(function, module, name):
    seen["functions"].append(name.decode())
    interpose.track_function(function)
def on_unload(module):
    seen["unloads"].append(module)
def on_launch(function, dims, shared, stream, params):
    seen["launches"].append([dims[i] for i in range(6)] + [ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int))[0]])
    if how["fail"]:
        raise ValueError("a hook that fails must not reach C")
    if how["interrupt"]:
        interpose.reraise_interrupt()
        seen["still_inside_after_reraise"] = True  # no KeyboardInterrupt in here
    interpose.answer_launch(how["answer"])
    return 0x7FFFFFFF  # never read: the answer is what counts

interpose.set_kernel_hooks(on_module, on_function, on_unload, on_launch, 2000)
module, cubin_module = p(), p()
load(ctypes.byref(module), b"//\n// Generated\n.version 8.0\n.target sm_90\n")
load(ctypes.byref(cubin_module), b"\x7fELF not text")
fn, short_fn = p(), p()
get(ctypes.byref(fn), module, b"long_kernel")
get(ctypes.byref(short_fn), module, b"k")
arg = ctypes.c_int(42)
params = (p * 1)(ctypes.addressof(arg))
out = {"seen_first": json.loads(json.dumps(seen))}

def run(f, times=1):
    results = []
    for _ in range(times):
        results.append(launch(f, 8, 1, 1, 128, 1, 1, 0, None, params, None))
        cuda.fake_gpu_catch_up()
    return results

cuda.fake_set_elapsed_ms(5.0)     # 5 ms: long
run(fn)                          # timed, then launched as it is
out["state_after_one_long"] = interpose.function_state(fn.value)
base, hooked = cuda.fake_launches(), len(seen["launches"])
run(fn, 2)                       # long, but no lease: nobody could end a yield
out["originals_without_lease"] = cuda.fake_launches() - base
out["hooked_without_lease"] = len(seen["launches"]) - hooked
block.publish(gate_closed=False, state=LeaseState.RUNNING)
base = cuda.fake_launches()
out["results_in_lease"] = run(fn, 2)  # handed to the hook: the original never runs
out["originals_in_lease"] = cuda.fake_launches() - base
block.set_unrivalled(True)  # nobody could preempt this session now: ready all the same
base, hooked = cuda.fake_launches(), len(seen["launches"])
run(fn, 2)
out["originals_unrivalled"] = cuda.fake_launches() - base
out["hooked_unrivalled"] = len(seen["launches"]) - hooked
block.set_unrivalled(False)  # a rival came: nothing changes for a long kernel
base, hooked = cuda.fake_launches(), len(seen["launches"])
run(fn)
out["hooked_rivalled_again"] = len(seen["launches"]) - hooked
cuda.fake_set_elapsed_ms(0.05)
base = cuda.fake_launches()
run(short_fn, 5)
out["short_state"] = interpose.function_state(short_fn.value)[0]
out["originals_of_short"] = cuda.fake_launches() - base
how["answer"] = interpose.LAUNCH_NOT_HANDLED
base = cuda.fake_launches()
run(fn)
out["declined_ran_original"] = cuda.fake_launches() - base
how["answer"], how["fail"] = 0, True
base = cuda.fake_launches()
out["result_of_failed_hook"] = run(fn)
out["failed_hook_ran_original"] = cuda.fake_launches() - base
how["fail"], how["interrupt"] = False, True
try:
    run(fn)
    time.sleep(0.5)
    out["interrupted_after"] = False
except KeyboardInterrupt:
    out["interrupted_after"] = True
how["interrupt"] = False
block.publish(gate_closed=False, state=None)  # the lease ended
base, hooked = cuda.fake_launches(), len(seen["launches"])
run(fn)
out["after_lease_original"] = cuda.fake_launches() - base
out["after_lease_hooked"] = len(seen["launches"]) - hooked
unload(module)
out["seen"] = seen
out["stats"] = interpose.stats()
print(json.dumps(out))
"""
)


def test_the_shim_hands_long_kernels_loaded_from_ptx_to_the_runtime(fake_driver, tmp_path):
    out = run_preloaded(PTX_SCRIPT, fake_driver, str(tmp_path))

    # Only the PTX text is reported (not the ELF image), and each function taken from it.
    assert out["seen_first"]["modules"] == ["//\n// Genera"]
    assert out["seen_first"]["functions"] == ["long_kernel", "k"]
    # One 5 ms launch makes a kernel long.
    assert out["state_after_one_long"][0] == interpose.TRACK_LONG
    assert out["state_after_one_long"][1] == pytest.approx(5000, rel=0.01)
    # Outside a lease nobody could end a yield: the original runs, the hook is not asked.
    assert out["originals_without_lease"] == 2 and out["hooked_without_lease"] == 0
    # In a lease the hook gets the launch's grid, block and parameters, and the original
    # does not run; the caller sees success whatever the hook's own return value was.
    assert out["originals_in_lease"] == 0 and out["results_in_lease"] == [0, 0]
    assert out["seen"]["launches"][0] == [8, 1, 1, 128, 1, 1, 42]
    # A kernel known to be long goes to the hook whether or not a rival exists: one run
    # as it is while nobody waited could not be stopped when somebody came.
    assert out["originals_unrivalled"] == 0 and out["hooked_unrivalled"] == 2
    assert out["hooked_rivalled_again"] == 1
    # Short kernels are left alone after a few timed launches.
    assert out["short_state"] == interpose.TRACK_SHORT
    assert out["originals_of_short"] == 5
    # A hook that declines gets the original launched.
    assert out["declined_ran_original"] == 1
    # A hook that raises: the original runs and the caller gets the driver's own answer.
    assert out["failed_hook_ran_original"] == 1 and out["result_of_failed_hook"] == [0]
    # A Ctrl-C the hook noted is raised once the hook has returned, never inside it.
    assert out["seen"]["still_inside_after_reraise"] is True
    assert out["interrupted_after"] is True
    # After the lease the original runs again.
    assert out["after_lease_original"] == 1 and out["after_lease_hooked"] == 0
    assert len(out["seen"]["unloads"]) == 1
    assert out["stats"]["ptx_modules"] == 1
    assert (
        out["stats"]["preemptible"] == 6
    )  # 2 in the lease, 2 unrivalled, 1 rivalled, 1 interrupted


NUMBA_SCRIPT = r"""
import json, re, sys
from gpushare_ext.runtime import interpose, preemptible
registry = preemptible.install()
out = {"installed": registry is not None, "numba_imported_before": "numba.cuda.codegen" in sys.modules}
from numba import cuda, float32
from numba.cuda import codegen
out["hooked"] = bool(getattr(codegen.CUDACodeLibrary.get_cufunc, "_gpushare", False))
from benchmarks.tenant import numba_relax
relax = numba_relax().py_func  # the stop benchmarks' Numba kernel, as Python

ptx, _ = cuda.compile_ptx(relax, (float32[:], float32[:], float32), cc=(9, 0))
name = re.search(r"\.entry\s+(\S+)\(", ptx).group(1)
registry.adopt(0x4242, ptx, name)
twin = registry.twins[0x4242]
out["has_twin"] = twin.kernel is not None
out["buffers"] = sorted(p.rsplit("_", 1)[1] for p in twin.kernel.report.buffers)
out["state"] = interpose.function_state(0x4242)[0]
print(json.dumps(out))
"""


def test_numba_kernels_are_handed_over_from_its_code_library(fake_driver):
    out = run_preloaded(NUMBA_SCRIPT, fake_driver)
    # Installed before Numba is imported, the hook is in place once it is.
    assert out["installed"] and not out["numba_imported_before"] and out["hooked"]
    # Numba's flattened array arguments: the data pointers are the buffers.
    assert out["has_twin"] and out["buffers"] == ["11", "4"]
    assert out["state"] == interpose.TRACK_TIMING


NUMBA_LINKED_SCRIPT = r"""
import json, re, sys, tempfile
from pathlib import Path
from gpushare_ext.runtime import interpose, preemptible
registry = preemptible.install()
from numba import cuda, float32, types
from numba.cuda.cudadrv.linkable_code import PTXSource
from gpushare_ext.runtime.frameworks.numba import linked_ptx

import os
sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests", "kernels"))
from numba_corpus import linked_relax_pair as pair  # the benchmark's numba_linked

ptx, name, callee = pair("c")
folder = Path(tempfile.mkdtemp())
(folder / "relax.ptx").write_text(callee)

class Library:  # what the hook reads of Numba's CUDACodeLibrary: its link= files
    _linking_files = {str(folder / "relax.ptx"), str(folder / "absent.cubin"),
                      PTXSource(b"// in memory\n", name="more")}

texts = linked_ptx(Library())
out = {"linked": [t.splitlines()[0] for t in texts]}
registry.adopt(0x4242, ptx, name, linked=texts)
registry.adopt(0x4243, ptx, name)
numba_abi, numba_name, _ = pair("numba")
registry.adopt(0x4244, numba_abi, numba_name, linked=[callee])
for handle in (0x4242, 0x4243, 0x4244):
    twin = registry.twins[handle]
    out[hex(handle)] = {"twin": twin.kernel is not None, "reason": twin.reason,
                        "state": interpose.function_state(handle)[0]}
out["saves"] = registry.twins[0x4242].kernel.preemptible(abort_checks=True).saves_state
print(json.dumps(out))
"""


def test_a_numba_kernel_is_handed_over_with_the_ptx_it_links(fake_driver):
    out = run_preloaded(NUMBA_LINKED_SCRIPT, fake_driver)
    # The PTX among its link= files, on disk or in memory; a cubin is not read.
    assert sorted(out["linked"]) == ["//", "// in memory"]
    # With its callee's body the kernel has a twin (and its threads save their state).
    assert out["0x4242"] == {"twin": True, "reason": "", "state": interpose.TRACK_TIMING}
    assert out["saves"] is True
    # Without it, or with a callee it declares with another ABI, it runs unmodified and
    # says why: the call it cannot see into.
    alone = out["0x4243"]
    assert not alone["twin"] and "call to gps_relax" in alone["reason"], alone
    assert "no body" in alone["reason"]
    mismatched = out["0x4244"]
    assert not mismatched["twin"] and "call to gps_relax" in mismatched["reason"], mismatched
    assert "Numba-ABI declaration of a C-ABI function" in mismatched["reason"]


IPC_SCRIPT = r"""
import ctypes, json
from gpushare_ext.runtime import interpose

p = ctypes.c_void_p
cuda = ctypes.CDLL("libcuda.so.1")
cuda.fake_ipc_opens.restype = ctypes.c_ulong
get_proc = cuda.cuGetProcAddress_v2
get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(p), ctypes.c_int, ctypes.c_uint64, p]
found = p()
assert get_proc(b"cuIpcOpenMemHandle", ctypes.byref(found), 12080, 0, None) == 0

class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]

OPEN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(p), Handle, ctypes.c_uint)
block = (ctypes.c_uint32 * 16)()  # a control block's first words
interpose.point_imports_at(ctypes.addressof(block))
out = {"before": interpose.ipc_imports(), "word_before": block[6]}
pointer = p()
handle = Handle(b"\x07" + b"\x00" * 63)
out["result"] = OPEN(found.value)(ctypes.byref(pointer), handle, 1)
out["pointer"] = pointer.value
out["after"] = interpose.ipc_imports()
out["word_after"] = block[6]  # offset 24: where the broker looks before a park
out["driver_saw"] = cuda.fake_ipc_opens()
print(json.dumps(out))
"""


def test_the_shim_counts_memory_opened_from_another_process(fake_driver):
    # Such a process is checkpointed and then cannot be restored: it must not be parked.
    seen = run_preloaded(IPC_SCRIPT, fake_driver)
    assert seen == {
        "before": 0, "word_before": 0, "result": 0, "pointer": 0x1007, "after": 1,
        "word_after": 1, "driver_saw": 1,
    }  # fmt: skip


def test_without_the_shim_preloaded_nobody_counts_imports():
    assert interpose.ipc_imports() is None


# ------------------------------------------------------------------ a gang's worker processes


def launch_until_stopped(flags: str) -> list[float]:
    """A rank's work on the fake driver: a launch every 10 ms until ``flags/stop``; when
    each launch went through."""
    import ctypes
    import time
    from pathlib import Path

    u, p = ctypes.c_uint, ctypes.c_void_p
    cuda = ctypes.CDLL("libcuda.so.1")
    get_proc = cuda.cuGetProcAddress_v2
    get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(p), ctypes.c_int, ctypes.c_uint64, p]
    found = p()
    assert get_proc(b"cuLaunchKernel", ctypes.byref(found), 12080, 0, None) == 0
    launch = ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p)(found.value)
    folder, times = Path(flags), []
    deadline = time.time() + 60
    while not (folder / "stop").exists() and time.time() < deadline:
        launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        times.append(time.time())
        (folder / "launched").touch()
        time.sleep(0.01)
    return times


@pytest.mark.parametrize("restarted", [False, True], ids=["same-broker", "after-restart"])
def test_a_gangs_rank_holds_its_launches_while_the_notebooks_session_is_paused(
    restarted, fake_driver, tmp_path, monkeypatch
):
    """After a broker restart the session has a new block; the rank maps the old one,
    which the session's relay keeps in step."""
    import cloudpickle

    from gpushare_ext.protocol import Placement
    from gpushare_ext.runtime.gate import GateRelay
    from gpushare_ext.runtime.ranks import run_ranks

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setenv("LD_PRELOAD", str(interpose.NATIVE))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_driver))
    monkeypatch.delenv("GPUSHARE_INTERPOSER", raising=False)
    session = ControlBlock.create(tmp_path / "session.cb")
    session.publish(gate_closed=False, state=LeaseState.RUNNING)
    rank = Placement(device_index=0, device_uuid="GPU-fake", memory_bytes=1 << 30)
    relay = GateRelay(session)
    results: list = []
    runner = threading.Thread(
        target=lambda: results.extend(
            run_ranks(launch_until_stopped, str(tmp_path), placements=[rank],
                      control_block=str(session.path), out=io.StringIO())
        )
    )  # fmt: skip
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "launched").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        broker_writes = session
        if restarted:
            broker_writes = ControlBlock.create(tmp_path / "after-restart.cb")
            relay.follow(broker_writes)
        broker_writes.publish(gate_closed=True, state=LeaseState.PAUSED)  # the broker's gate
        closed_at = time.time()
        time.sleep(1.0)
        opened_at = time.time()
        broker_writes.publish(gate_closed=False, state=LeaseState.RUNNING)
        time.sleep(0.3)
    finally:
        (tmp_path / "stop").touch()
        runner.join(timeout=60)
        relay.close()
    (times,) = results
    # At most the launch under way when the gate closed went through, none after.
    assert len([t for t in times if closed_at + 0.05 < t < opened_at]) == 0
    assert any(t < closed_at for t in times) and any(t > opened_at for t in times)


# ------------------------------------------------------------------ long kernels run as they are

LONG_QUEUE_SCRIPT = (
    DRIVER_ENTRIES
    + r"""
import json, os, signal, sys, threading, time
from gpushare_ext.runtime import interpose

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p)
cuda.fake_launches.restype = ctypes.c_ulong
cuda.fake_set_elapsed_ms.argtypes = [ctypes.c_float]
launch = entry(b"cuLaunchKernel", LAUNCH)
library = interpose.native_library()
message = ctypes.create_string_buffer(256)
assert library.gps_activate_preload(message, 256) == 0, message.value
long_fn = p(0x4242)
interpose.track_function(long_fn.value)

def run_one():
    return launch(long_fn, 8, 1, 1, 128, 1, 1, 0, None, None, None)

cuda.fake_set_elapsed_ms(500.0)  # a launch of half a second: long
run_one()
cuda.fake_gpu_catch_up()         # the timed launch is done
out = {"state": interpose.function_state(long_fn.value)[0]}
spent = p()  # the stand-in counts the next event made as complete: use that one up
cuda.cuEventCreate(ctypes.byref(spent), 0)
base = cuda.fake_launches()
run_one(); run_one()             # no lease: both go to the GPU at once (two in flight)
out["first_two_issued"] = cuda.fake_launches() - base
# A third must wait for the first to finish; a Ctrl-C meanwhile drops it.
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
started = time.monotonic()
try:
    run_one()  # Python raises the KeyboardInterrupt as soon as the launch has returned
    time.sleep(1.0)
    out["interrupted"] = False
except KeyboardInterrupt:
    out["interrupted"] = True
out["waited_s"] = time.monotonic() - started
out["issued_after_interrupt"] = cuda.fake_launches() - base
cuda.fake_gpu_catch_up()         # the GPU finishes what it had
run_one()
out["issued_after_catch_up"] = cuda.fake_launches() - base
out["stats"] = interpose.stats()
print(json.dumps(out))
"""
)


def test_ctrl_c_drops_a_long_kernel_launch_waiting_behind_two_on_the_gpu(fake_driver, tmp_path):
    """Outside a lease a long kernel runs as it is, but at most two of its launches are
    on the GPU: a third waits on the host, and Ctrl-C drops it (never issued, the caller
    told success so no framework sees a failure), then Python raises KeyboardInterrupt."""
    out = run_preloaded(LONG_QUEUE_SCRIPT, fake_driver, str(tmp_path))

    assert out["state"] == interpose.TRACK_LONG
    assert out["first_two_issued"] == 2
    assert out["interrupted"]
    assert 0.25 < out["waited_s"] < 1.2  # it waited until the Ctrl-C, then returned
    assert out["issued_after_interrupt"] == 2  # the third never reached the driver
    assert out["issued_after_catch_up"] == 3  # the next goes once the GPU caught up
    assert out["stats"]["dropped"] == 1 and out["stats"]["long_waits"] == 1
