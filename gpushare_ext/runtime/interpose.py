"""The launch interposer, from Python: hold every framework's launches while paused.

A notebook's GPU work mostly comes from code gpushare did not write (CuPy's array
operations, PyTorch and cuBLAS/cuDNN under it, Numba).  The native library
``native/libgpushare_interpose.so`` stands between them and the driver, so while the
broker holds the session paused each launch waits on the host before it reaches the
GPU, and the work in flight stays at about ``DEFAULT_QUEUE_US`` of GPU time: a pause
drains in a few kernels instead of a whole queue.

How it gets between them:

* **preloaded** (the default): the gpushare Jupyter server extension puts the library
  in ``LD_PRELOAD`` for the kernels its server starts.  It overrides ``dlsym`` and
  wraps the launch entry points that ``dlsym`` and ``cuGetProcAddress`` hand out,
  which is how CuPy, PyTorch's CUDA runtime and cuBLAS reach the driver.  Inert until
  a session points it at its control block; the checkpoint lock and eviction keep
  working.
* **CUPTI** (``GPUSHARE_INTERPOSER=cupti``): attaches to a kernel already running, but
  once CUPTI is in a process the checkpoint lock answers NOT_SUPPORTED for it (also
  after unsubscribing; measured on an H200), so levels 3 and 4 are lost.  Opt-in.

A kernel started some other way (no preload) is paused by the checkpoint lock alone,
and the session says so.  This module finds the library and speaks to it; it decides
nothing.  Without a GPU it is still testable: ``use_driver`` hands the native code a
fake driver table, and a fake ``libcuda.so.1`` exercises the preloaded path.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gpushare_ext.runtime.errors import SessionError

NATIVE = Path(__file__).with_name("native") / "libgpushare_interpose.so"
GATE_OFFSET = 8  # the control block's words (control_block.py)
STATE_OFFSET = 12
IPC_IMPORTS_OFFSET = 24
UNRIVALLED_OFFSET = 28
DEFAULT_WINDOW = 2  # until a launch's GPU time is known, and in the fixed mode
DEFAULT_RECORD_EVERY = 4
DEFAULT_QUEUE_US = 3000  # GPU work kept queued: drains in ~3 ms, keeps small kernels fed
# ... and while a session that could preempt this one exists: a pause drains about this
# much (and at most one launch behind the running one), for a little more waiting here.
DEFAULT_RIVALLED_QUEUE_US = 1000


class InterposerError(SessionError):
    """The interposer cannot be attached here; the message says why in one line."""


class Stats(ctypes.Structure):
    _fields_ = [
        ("launches", ctypes.c_uint64),
        ("held", ctypes.c_uint64),
        ("held_ns", ctypes.c_uint64),
        ("window_waits", ctypes.c_uint64),
        ("window_wait_ns", ctypes.c_uint64),
        ("captured", ctypes.c_uint64),
        ("driver_errors", ctypes.c_uint64),
        ("interrupted", ctypes.c_uint64),
        ("per_launch_ns", ctypes.c_uint64),
        ("window", ctypes.c_uint64),
        ("record_every", ctypes.c_uint64),
        ("preemptible", ctypes.c_uint64),
        ("ptx_modules", ctypes.c_uint64),
        ("cooperative", ctypes.c_uint64),
        ("with_attributes", ctypes.c_uint64),
        ("graphs", ctypes.c_uint64),
        ("long_waits", ctypes.c_uint64),
        ("dropped", ctypes.c_uint64),
        ("hold_queued_us_first", ctypes.c_uint64),
        ("hold_queued_us_max", ctypes.c_uint64),
        ("hold_queued_launches_max", ctypes.c_uint64),
    ]

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


CUresult = ctypes.c_int
EVENT_CREATE = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
EVENT_OP = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p)
EVENT_RECORD = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.c_void_p)
IS_CAPTURING = ctypes.CFUNCTYPE(CUresult, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
ELAPSED = ctypes.CFUNCTYPE(
    CUresult, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p
)


# The launch shim's hooks for kernels loaded from PTX (see runtime/preemptible.py).
MODULE_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
FUNCTION_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
UNLOAD_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
LAUNCH_HOOK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint,
    ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
)  # fmt: skip
LAUNCH_NOT_HANDLED = -1  # the launch hook's answer: launch the original kernel
TRACK_TIMING, TRACK_LONG, TRACK_SHORT, TRACK_OFF = 0, 1, 2, 3
DEFAULT_LONG_US = 2000  # a kernel this long is run preemptibly (a pause waits less)


class DriverTable(ctypes.Structure):
    """The driver entry points the native code calls (``gps_driver`` in the C source)."""

    _fields_ = [
        ("event_create", EVENT_CREATE),
        ("event_record", EVENT_RECORD),
        ("event_query", EVENT_OP),
        ("event_synchronize", EVENT_OP),
        ("event_destroy", EVENT_OP),
        ("stream_is_capturing", IS_CAPTURING),
        ("event_elapsed", ELAPSED),
    ]


_library: ctypes.CDLL | None = None
MODES = ("auto", "cupti", "off")


def shim_path() -> Path:
    """What to put in ``LD_PRELOAD`` of a kernel (by the server extension)."""
    return NATIVE


def preloaded_here() -> bool:
    """Whether this process runs with the shim preloaded (so the processes it starts,
    which inherit ``LD_PRELOAD``, have it too)."""
    return _preloaded() is not None


def _preloaded() -> ctypes.CDLL | None:
    """The process's global scope, if a preloaded copy of the library is in it."""
    everything = ctypes.CDLL(None)
    probe = getattr(everything, "gps_preloaded", None)
    if probe is None:
        return None
    probe.restype = ctypes.c_int
    return everything if probe() else None


def native_library() -> ctypes.CDLL:
    """The native interposer (the preloaded copy if there is one), loaded once;
    InterposerError if it was not built."""
    global _library
    if _library is not None:
        return _library
    library = _preloaded()
    if library is None:
        if not NATIVE.exists():
            raise InterposerError(
                f"the launch interposer was not built ({NATIVE.name} is missing: no C "
                "compiler when gpushare-ext was installed)"
            )
        library = ctypes.CDLL(str(NATIVE))
    library.gps_attach.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    library.gps_attach.restype = ctypes.c_int
    library.gps_set_block.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.gps_set_rival_word.argtypes = [ctypes.c_void_p]
    library.gps_set_window.argtypes = [ctypes.c_uint, ctypes.c_uint]
    library.gps_set_target.argtypes = [ctypes.c_uint, ctypes.c_uint]
    library.gps_get_stats.argtypes = [ctypes.POINTER(Stats)]
    library.gps_use_driver.argtypes = [ctypes.POINTER(DriverTable)]
    library.gps_launch_enter.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.gps_launch_enter.restype = ctypes.c_int
    library.gps_launch_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    library.gps_launch_exit.restype = ctypes.c_int
    library.gps_attached.restype = ctypes.c_int
    library.gps_preloaded.restype = ctypes.c_int
    library.gps_activate_preload.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    library.gps_activate_preload.restype = ctypes.c_int
    library.gps_set_kernel_hooks.argtypes = [
        MODULE_HOOK, FUNCTION_HOOK, UNLOAD_HOOK, LAUNCH_HOOK, ctypes.c_uint,
    ]  # fmt: skip
    library.gps_track_function.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.gps_track_function.restype = ctypes.c_int
    library.gps_function_state.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)]
    library.gps_function_state.restype = ctypes.c_int
    library.gps_ipc_imports.restype = ctypes.c_ulonglong
    library.gps_interrupts.restype = ctypes.c_ulonglong
    library.gps_launch_answer.argtypes = [ctypes.c_int]
    library.gps_set_exempt.argtypes = [ctypes.c_int]
    _library = library
    return library


def find_cupti() -> str | None:
    """A CUPTI library matching this process's CUDA, or None.

    ``$GPUSHARE_CUPTI`` first; then the pip wheels (``nvidia-cuda-cupti``: CUDA 13 puts
    it under ``nvidia/cu13/lib``, CUDA 12 under ``nvidia/cuda_cupti/lib``); then a CUDA
    toolkit's ``extras/CUPTI``.
    """
    explicit = os.environ.get("GPUSHARE_CUPTI")
    if explicit:
        return explicit
    patterns = []
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        patterns += [
            str(base / "cu13" / "lib" / "libcupti.so*"),
            str(base / "cuda_cupti" / "lib" / "libcupti.so*"),
        ]
    patterns += [
        "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so*",
        "/usr/local/cuda-*/extras/CUPTI/lib64/libcupti.so*",
        "/usr/lib/x86_64-linux-gnu/libcupti.so*",
    ]
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return None


@dataclass
class Attached:
    """The interposer in this process: how much work it lets queue."""

    queue_us: int
    window: int
    record_every: int
    mechanism: str  # "preload" or "cupti"
    rivalled_queue_us: int = 0  # the tighter target while a rival exists (0: queue_us)

    def describe(self) -> str:
        how = "launch shim" if self.mechanism == "preload" else "CUPTI"
        if self.queue_us:
            bound = f"about {self.queue_us / 1000:g} ms of GPU work in flight at most"
            if 0 < self.rivalled_queue_us < self.queue_us:
                bound += (
                    f" ({self.rivalled_queue_us / 1000:g} ms while another session could "
                    "preempt this one)"
                )
        elif self.window == 0:
            bound = "no bound on work in flight"
        else:
            bound = f"at most about {self.window * self.record_every} launches in flight"
        return f"launches held on the host while paused ({how}); {bound}"


_attached: Attached | None = None


def _setting(name: str, given: int | None, default: int) -> int:
    text = os.environ.get(name)
    if text is not None:
        try:
            return max(0, int(text))
        except ValueError:
            raise InterposerError(f"{name}={text!r} is not a whole number") from None
    return default if given is None else given


def attach(
    block_address: int,
    *,
    queue_us: int | None = None,
    window: int | None = None,
    record_every: int | None = None,
) -> Attached:
    """Start holding and bounding launches, following the control block at ``block_address``.

    ``queue_us`` (``$GPUSHARE_QUEUE_US``) is the GPU time allowed in flight; 0 uses the
    fixed ``window`` x ``record_every`` (``$GPUSHARE_WINDOW``, ``$GPUSHARE_RECORD_EVERY``;
    a window of 0 turns the bound off).
    """
    global _attached
    mode = os.environ.get("GPUSHARE_INTERPOSER", "auto").strip().lower()
    if mode not in MODES:
        raise InterposerError(f"GPUSHARE_INTERPOSER={mode!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        raise InterposerError("turned off by GPUSHARE_INTERPOSER=off")
    library = native_library()
    queue_us = _setting("GPUSHARE_QUEUE_US", queue_us, DEFAULT_QUEUE_US)
    rivalled_us = _setting("GPUSHARE_QUEUE_US_RIVALLED", None, DEFAULT_RIVALLED_QUEUE_US)
    window = _setting("GPUSHARE_WINDOW", window, DEFAULT_WINDOW)
    record_every = _setting("GPUSHARE_RECORD_EVERY", record_every, DEFAULT_RECORD_EVERY)
    if _attached is None:
        message = ctypes.create_string_buffer(512)
        if library.gps_preloaded():
            if library.gps_activate_preload(message, len(message)) != 0:
                raise InterposerError(message.value.decode(errors="replace"))
            mechanism = "preload"
        elif mode == "cupti":
            cupti = find_cupti()
            if cupti is None:
                raise InterposerError(
                    "no CUPTI library found (install nvidia-cuda-cupti, or set GPUSHARE_CUPTI)"
                )
            if library.gps_attach(cupti.encode(), message, len(message)) != 0:
                raise InterposerError(message.value.decode(errors="replace"))
            mechanism = "cupti"
        else:
            raise InterposerError(
                "this kernel was started without the launch shim (kernels that a Jupyter "
                f"server with gpushare starts have it; or set LD_PRELOAD={NATIVE} before "
                "the kernel starts)"
            )
        _attached = Attached(queue_us=0, window=0, record_every=0, mechanism=mechanism)
    library.gps_set_window(window, record_every)
    library.gps_set_target(queue_us if window else 0, rivalled_us)
    _attached.queue_us = queue_us if window else 0
    _attached.rivalled_queue_us = rivalled_us
    _attached.window, _attached.record_every = window, record_every
    point_at(block_address)
    return _attached


def bound(enabled: bool) -> None:
    """Bound the work in flight (a session that may be paused) or not (one at the top:
    nobody pauses it, and a bound would only make its own requests wait)."""
    attached_now = _attached
    if attached_now is None:
        return
    library = native_library()
    if enabled:
        library.gps_set_window(attached_now.window, attached_now.record_every)
        library.gps_set_target(attached_now.queue_us, attached_now.rivalled_queue_us)
    else:
        library.gps_set_window(0, attached_now.record_every)


def point_at(block_address: int | None) -> None:
    """Follow a new control block (after a reconnect); None: never hold."""
    library = native_library()
    if block_address is None:
        library.gps_set_rival_word(None)
        library.gps_set_block(None, None)
    else:
        library.gps_set_rival_word(block_address + UNRIVALLED_OFFSET)
        library.gps_set_block(block_address + GATE_OFFSET, block_address + STATE_OFFSET)


def point_imports_at(block_address: int | None) -> None:
    """Have the preloaded shim keep its count of imports in this control block (the
    broker reads it just before a park); nothing when the shim is not preloaded."""
    library = _preloaded()
    if library is None:
        return
    library.gps_set_import_word.argtypes = [ctypes.c_void_p]
    library.gps_set_import_word(
        None if block_address is None else block_address + IPC_IMPORTS_OFFSET
    )


def ipc_imports() -> int | None:
    """How many times this process opened another process's GPU memory (CUDA IPC or a
    shareable handle), as the preloaded shim counted; None when the shim is not
    preloaded here (then nobody counted)."""
    library = _preloaded()
    if library is None:
        return None
    library.gps_ipc_imports.restype = ctypes.c_ulonglong
    return int(library.gps_ipc_imports())


def stats() -> dict[str, int]:
    library = native_library()
    out = Stats()
    library.gps_get_stats(ctypes.byref(out))
    return out.as_dict()


def detach() -> None:
    global _attached
    if _library is not None:
        _library.gps_detach()
    _attached = None


def use_driver(table: DriverTable | None) -> None:
    """Tests: the native code calls these entry points instead of the CUDA driver's."""
    library = native_library()
    library.gps_use_driver(ctypes.byref(table) if table is not None else None)


_hooks: tuple | None = None  # the ctypes callbacks must outlive their use in C


def set_kernel_hooks(
    on_module: object, on_function: object, on_unload: object, on_launch: object,
    long_us: int = DEFAULT_LONG_US,
) -> None:  # fmt: skip
    """Be told of modules loaded from PTX and functions taken from them, and run the
    launches of tracked functions found long (``runtime/preemptible.py``)."""
    global _hooks
    library = native_library()
    hooks = (
        MODULE_HOOK(on_module), FUNCTION_HOOK(on_function),
        UNLOAD_HOOK(on_unload), LAUNCH_HOOK(on_launch),
    )  # fmt: skip
    library.gps_set_kernel_hooks(*hooks, long_us)
    _hooks = hooks


def clear_kernel_hooks() -> None:
    global _hooks
    if _library is not None and _hooks is not None:
        _library.gps_set_kernel_hooks(
            MODULE_HOOK(), FUNCTION_HOOK(), UNLOAD_HOOK(), LAUNCH_HOOK(), DEFAULT_LONG_US
        )
    _hooks = None


def watch_interrupts() -> int | None:
    """Put the shim's SIGINT handler in front of Python's and return how many Ctrl-Cs it
    has counted so far; None where the shim is not loaded (nothing counts them)."""
    if _library is None and _preloaded() is None:
        return None
    library = native_library()
    library.gps_chain_sigint()
    return int(library.gps_interrupts())


def interrupts_seen() -> int:
    """How many Ctrl-Cs the shim's handler has counted (see :func:`watch_interrupts`)."""
    return int(native_library().gps_interrupts())


def answer_launch(answer: int) -> None:
    """Inside the launch hook: the launch was run (0), or the original must run
    (``LAUNCH_NOT_HANDLED``).  The shim reads this, never the hook's return value."""
    native_library().gps_launch_answer(answer)


def reraise_interrupt() -> None:
    """Inside the launch hook: a Ctrl-C came; the shim raises SIGINT again once the hook
    has returned, so the cell stops right after the launch, outside the callback."""
    native_library().gps_reraise_interrupt()


def exempt_from_hold(exempt: bool) -> None:
    """This thread's launches are not held while the session is paused (the launches that
    finish a transaction Ctrl-C interrupted); reset by the shim when the hook returns."""
    native_library().gps_set_exempt(1 if exempt else 0)


def track_function(function: int, state: int = TRACK_TIMING) -> bool:
    """Have the shim time ``function``'s launches (or set its state); False if full."""
    return native_library().gps_track_function(function, state) == 0


def function_state(function: int) -> tuple[int, float]:
    """(state, longest launch timed in microseconds); state -1 if not tracked."""
    longest = ctypes.c_float()
    state = native_library().gps_function_state(function, ctypes.byref(longest))
    return state, float(longest.value)
