"""Long kernels a notebook loads from PTX, run preemptibly with no change to its code.

What it is for: the launch shim (``interpose``) tells this module of every module a
framework loads from PTX text (CuPy compiling its generated and user kernels to PTX, a
``RawModule`` of PTX) and of every function taken from one; Numba, which links its
kernels to a cubin itself, hands over each kernel's PTX as it loads it (a hook on its
code library, installed when Numba is imported).  The shim times each function's first
launches, and once one took longer than the drain a pause should cost
(``GPUSHARE_PREEMPTIBLE_US``, 2 ms), its later launches come here instead of going to
the GPU as they are.  The function then goes through the same analysis and transform as
``gpushare_ext.kernel`` (``gpushare_ext/kernels``), once: at that first long launch
(CuPy loads many short kernels that never need it), or as Numba loads it.  Each one is then classified *with its actual buffers* (two
arguments in one allocation are one buffer, so an in-place call is seen) and run as a
transaction:

* flag checks at loop back-edges stop it within a few hundred loop iterations.  Where
  the kernel's threads hold all their state in registers (no shared or local memory,
  no barriers: CuPy's elementwise kernels, most Numba kernels), a stopping thread saves
  its live registers and the next slice goes on from them: nothing is lost or redone;
* else, idempotent: *restart*: it goes on from the lowest logical block an abort left;
* else, not idempotent: *snapshot*: the buffers it writes are copied first, an abort
  rolls them back and it runs again; a yield between logical blocks resumes;
* after ``MAX_ABORTS`` aborts that were undone (restart or rollback), a launch goes on
  with yields between logical blocks only, so one whose blocks outlast the gaps between
  preemptions still finishes;
* unknown (a pointer loaded from memory, a call into code that touches memory or whose
  PTX it was not given ...), or a kernel the transform refuses:
  the original runs unmodified, under the shim and the checkpoint lock, and the cell
  says so once, with the reason.

The mode is chosen by the one rule every launch goes by,
:func:`gpushare_ext.kernels.launch.decide_launch` (``for_shim``: its restart and its
"run as it is"); this module only gives it the buffers and the kernel's timing.

Only while the session holds a lease: outside one nobody could ever end a yield, so
the shim runs the original (held while paused, like every launch).

The launch returns when the kernel is done (paused meanwhile, perhaps): the caller's
stream order is kept because nothing is launched behind it until then.  A Ctrl-C during
it ends it whole at once: rolled back where it has a snapshot (every launch that is not
idempotent, and idempotent ones of kernels that run ``kernels.launch.FINISH_BOUND_US``,
250 ms, or more), else run to its end without stopping; the shim raises the Ctrl-C once
the hook has returned.
So a buffer is either untouched or fully written, and the cell gets control back.

What it must not do: decide when to preempt (the broker raises the session's yield flag
and writes the control block), import CUDA or CuPy at import time, or let an exception
reach the C caller: every failure ends in "launch the original".
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare_ext.runtime import cell_lines, frameworks, interpose

__all__ = [
    "DEFAULT_LONG_US",
    "Registry",
    "install",
    "installed",
    "summary",
    "uninstall",
]

DEFAULT_LONG_US = interpose.DEFAULT_LONG_US
MAX_MODULES = 4096  # PTX texts kept; older ones are forgotten (their kernels run as they are)
# Aborts of one launch before it goes on with yields between logical blocks only: a
# launch whose logical blocks outlast the gaps between preemptions must still finish.
MAX_ABORTS = 3


@dataclass
class Twin:
    """One function taken from a PTX module: its analysed kernel, or why it has none."""

    name: str
    module: int
    ptx: bytes = b""  # kept until the analysis has run
    linked: tuple[str, ...] = ()  # the PTX it is linked with (Numba's link=), as long
    kernel: Any = None  # gpushare_ext.kernels.frontends.Kernel
    reason: str = ""  # why it runs unmodified (empty: it has a preemptible twin)
    said: bool = False
    launches: int = 0
    analysis_ns: int = 0  # host time of its analysis and transform

    @property
    def analysed(self) -> bool:
        return not self.ptx

    def analyse(self) -> None:
        """Analyse and transform now (once): sets ``kernel``, or ``reason``."""
        if self.ptx:
            began = time.perf_counter_ns()
            self.kernel, self.reason = _analyse(self.ptx, self.name, self.linked)
            self.analysis_ns = time.perf_counter_ns() - began
            self.ptx, self.linked = b"", ()


@dataclass
class Registry:
    """What the shim has told us, and what was done with it (one per process)."""

    modules: dict[int, bytes] = field(default_factory=dict)
    twins: dict[int, Twin] = field(default_factory=dict)
    launched: int = 0  # launches run preemptibly
    yields: int = 0
    aborts: int = 0  # undone: restarted or rolled back
    saves: int = 0  # aborts whose threads saved their state and went on
    fallbacks: int = 0  # launches given back to run unmodified
    interrupted: int = 0  # launches Ctrl-C ended whole (rolled back or finished)
    # Launches that ran whole with the shim's time of the original known: their GPU
    # time as run preemptibly, and what their unmodified runs took.
    preemptible_ns: int = 0
    original_ns: int = 0
    said: list[str] = field(default_factory=list)
    said_keys: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- hooks (called by the shim through ctypes; never raise)

    def on_module(self, module: int, image: int) -> None:
        try:
            text = ctypes.string_at(image)
        except Exception:  # an unreadable image is not ours to analyse
            return
        with self.lock:
            if len(self.modules) >= MAX_MODULES:
                self.modules.pop(next(iter(self.modules)))
            self.modules[int(module)] = text

    def on_function(self, function: int, module: int, name: bytes) -> None:
        # Analysed only once a launch was found long: CuPy loads many short kernels.
        text = self.modules.get(int(module or 0))
        if text is not None and function:
            self._track(
                function, Twin(name=name.decode("ascii", "replace"), module=int(module), ptx=text)
            )

    def adopt(self, function: int, ptx: str, name: str, linked: Sequence[str] = ()) -> None:
        """A function whose PTX a framework hands over itself (Numba links to a cubin,
        so the shim never sees its PTX): analysed now (a Numba compile dwarfs it) and
        tracked like one the shim saw.  ``linked``: the PTX texts it is linked with
        (Numba's ``link=``), where the device functions it declares have their bodies."""
        twin = Twin(name=name, module=0, ptx=ptx.encode("ascii", "replace"), linked=tuple(linked))
        twin.analyse()
        self._track(function, twin)

    def _track(self, function: int, twin: Twin) -> None:
        try:
            with self.lock:
                self.twins[int(function)] = twin
            interpose.track_function(int(function), interpose.TRACK_TIMING)
        except Exception:  # keep the framework's call whole
            return

    def on_unload(self, module: int) -> None:
        with self.lock:
            self.modules.pop(int(module or 0), None)
            gone = [f for f, t in self.twins.items() if t.module == int(module or 0)]
            for function in gone:
                del self.twins[function]
        for function in gone:
            interpose.track_function(function, interpose.TRACK_OFF)

    def on_launch(self, function: int, dims: Any, shared: int, stream: int, params: Any) -> int:
        """The shim's launch hook.  Nothing may leave it: an exception that escapes a
        ctypes callback reaches C as an undefined result, so the shim reads the answer
        given through ``interpose.answer_launch`` instead, and a Ctrl-C is noted here
        (the launch ends whole) and raised by the shim once this has returned."""
        ctrl_c = _CtrlC()
        try:
            with ctrl_c:
                self._launch(function, dims, shared, stream, params, ctrl_c)
        except BaseException as exc:  # a KeyboardInterrupt the note could not catch
            if isinstance(exc, KeyboardInterrupt):
                ctrl_c.pressed = True
        if ctrl_c.pressed:
            with contextlib.suppress(BaseException):
                interpose.reraise_interrupt()
        return 0

    def _launch(
        self, function: int, dims: Any, shared: int, stream: int, params: Any, ctrl_c: _CtrlC
    ) -> None:
        twin = self.twins.get(int(function or 0))
        if twin is None:
            return
        try:
            twin.analyse()
        except Exception as exc:  # the analysis itself failed: the original runs
            twin.ptx, twin.reason = b"", _reason_of(exc)
        if twin.kernel is None:
            self._give_up(function, twin, twin.reason)
            return
        try:
            grid = (int(dims[0]), int(dims[1]), int(dims[2]))
            block = (int(dims[3]), int(dims[4]), int(dims[5]))
            _report(f"running `{twin.name}` preemptibly; {summary()}")
            longest_us = interpose.function_state(int(function))[1]
            report = run_launch(
                twin.kernel, grid, block, int(shared), int(stream or 0), params,
                interrupted=ctrl_c.is_pressed, longest_us=longest_us,
            )  # fmt: skip
        except Exception as exc:  # the original kernel runs instead
            self._give_up(function, twin, _reason_of(exc))
            return
        if report is None:  # host or managed memory among its arguments
            self.fallbacks += 1
            self._say_once(
                f"memory:{twin.name}", cell_lines.unmodified_with_host_memory_line(twin.name)
            )
            return
        interpose.answer_launch(0)  # done: the shim must not launch the original too
        twin.launches += 1
        self.launched += 1
        self.yields += report.yields
        self.aborts += report.aborts
        self.saves += report.saves
        if report.interrupted:
            self.interrupted += 1
        self._count_cost(report, longest_us)
        _report(summary())

    def _count_cost(self, report: Any, longest_us: float) -> None:
        """Add a launch's GPU time beside its original's, where both measure the whole
        kernel: a launch rolled back by a Ctrl-C did not run it all, and one whose slices
        left no stamps has no time to compare."""
        if longest_us <= 0 or report.gpu_ns <= 0 or report.interrupted == "rolled back":
            return
        self.preemptible_ns += int(report.gpu_ns)
        self.original_ns += round(longest_us * 1000)

    def _say_once(self, key: str, line: str) -> None:
        """Say ``line`` in the cell that ran the launch (its stderr), once per process."""
        if key in self.said_keys:
            return
        self.said_keys.add(key)
        self.said.append(line)
        _to_stderr(line)

    def _give_up(self, function: int, twin: Twin, reason: str) -> None:
        self.fallbacks += 1
        twin.kernel = None
        twin.reason = reason
        interpose.track_function(int(function), interpose.TRACK_OFF)
        if not twin.said:
            twin.said = True
            line = cell_lines.unmodified_line(twin.name, reason)
            self.said.append(line)
            _to_stderr(line)  # the cell's stderr: the note lands in the cell that ran it
        _report(f"`{twin.name}` runs unmodified ({reason}); {summary()}")


class _CtrlC:
    """While a launch runs inside the shim's hook, a Ctrl-C is noted, not raised.

    Python raises KeyboardInterrupt in the main thread at the next bytecode, which inside
    the hook would be in the middle of a transaction (or escape into C).  So for the
    hook's length the main thread's SIGINT handler only notes the press; the transaction
    asks :meth:`is_pressed` and ends the launch whole, and the shim raises the signal
    again once the hook has returned.  Other threads never see KeyboardInterrupt."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None

    def is_pressed(self) -> bool:
        return self.pressed

    def _note(self, signum: int, frame: Any) -> None:
        self.pressed = True

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError, OSError):
                previous = signal.getsignal(signal.SIGINT)
                if previous is not None:  # None: not Python's to swap
                    signal.signal(signal.SIGINT, self._note)
                    self._previous = previous
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _reason_of(exc: Exception) -> str:
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return message.splitlines()[0][:300]


def _analyse(ptx: bytes, name: str, linked: Sequence[str] = ()) -> tuple[Any, str]:
    """(the analysed kernel for ``name`` in ``ptx``, "") or (None, why it has none).
    The device functions it declares and ``linked`` defines are put into its module
    first (``kernels/linking.py``), so that the analysis sees their bodies and the twin
    loads without a linker."""
    from gpushare_ext.kernels import Idempotence, Kernel, KernelError
    from gpushare_ext.kernels.linking import link_device_functions

    try:
        text = ptx.decode("ascii", "replace")
        linking = link_device_functions(text, linked) if linked else None
        kernel = Kernel(linking.text if linking else text, name, origin="ptx")
        report = kernel.report
        if report.classification.verdict is Idempotence.UNKNOWN:
            why = report.classification.reasons[0] if report.classification.reasons else ""
            if linking is not None and linking.notes:
                why = "; ".join((why, *linking.notes))
            return None, f"the analysis cannot tell what it writes: {why}".rstrip(": ")
        kernel.preemptible(abort_checks=bool(report.loops))  # refused here, not at launch
    except KernelError as exc:
        return None, exc.message
    return kernel, ""


# ---- one launch


def _allocation_extent(address: int) -> tuple[int, int] | None:
    """(address, bytes from it to the end of its allocation), or None if not device memory."""
    from cuda.bindings import driver

    err, base, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(address))
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return address, int(base) + int(size) - address


def raw_arguments(kernel: Any, params: Any) -> Any:
    """The launch's arguments as the shim got them (an array of pointers to each value),
    with each pointer parameter's extent: up to the end of its allocation.  None when a
    pointer is not device memory (host or managed memory: the buffers are not known)."""
    from gpushare_ext.kernels.arguments import BoundArgs

    values = [ctypes.string_at(params[i], p.size) for i, p in enumerate(kernel.entry.params)]
    index = {p.name: i for i, p in enumerate(kernel.entry.params)}
    extents: dict[str, tuple[int, int]] = {}
    for name in kernel.report.pointer_params:
        param, _, offset = name.partition("@")
        raw = values[index[param]]
        (address,) = struct.unpack_from("<Q", raw, int(offset or 0))
        if address == 0:
            extents[name] = (0, 0)
            continue
        extent = _allocation_extent(address)
        if extent is None:
            return None
        extents[name] = extent
    return BoundArgs(values, extents, {})


def run_launch(
    kernel: Any, grid: tuple, block: tuple, shared: int, stream: int, params: Any,
    *, interrupted: Callable[[], bool] | None = None, longest_us: float = 0.0,
) -> Any:  # fmt: skip
    """Run one launch taken by the shim as a transaction; None if it must run as it is.
    ``interrupted()`` says a Ctrl-C came: the launch then ends whole at once."""
    from dataclasses import replace

    from gpushare_ext.kernels.launch import (
        LaunchMode,
        decide_launch,
        launch_kernel,
        session_hooks,
    )

    bound = raw_arguments(kernel, params)
    if bound is None:
        return None
    # The shim's launches are stopped at back-edges and have the original to fall back
    # on: restart for an idempotent launch, and "off" (run as it is) where the analysis
    # cannot tell what it writes.
    decision = decide_launch(kernel, bound.extents, for_shim=True, longest_us=longest_us)
    if decision.mode is LaunchMode.OFF:
        return None
    hooks = session_hooks()
    if interrupted is not None:
        hooks = replace(hooks, interrupted=interrupted, exempt_from_hold=interpose.exempt_from_hold)
    return launch_kernel(
        kernel, grid, block, (), stream=stream, shared_mem=shared, decision=decision,
        abort_checks=bool(kernel.report.loops), bound=bound, max_aborts=MAX_ABORTS,
        hooks=hooks,
    )  # fmt: skip


# ---- the process's registry


_registry: Registry | None = None


def _long_us() -> int:
    text = os.environ.get("GPUSHARE_PREEMPTIBLE_US", "").strip()
    if not text:
        return DEFAULT_LONG_US
    try:
        return max(0, int(text))
    except ValueError:
        raise interpose.InterposerError(
            f"GPUSHARE_PREEMPTIBLE_US={text!r} is not a whole number of microseconds"
        ) from None


def install() -> Registry | None:
    """Be told of PTX modules from now on (once per process); None where the shim is not
    preloaded or ``GPUSHARE_PREEMPTIBLE_US=0`` turns this off."""
    global _registry
    if _registry is not None:
        return _registry
    long_us = _long_us()
    if long_us == 0:
        return None
    try:
        library = interpose.native_library()
    except interpose.InterposerError:
        return None
    if not library.gps_preloaded():
        return None
    message = ctypes.create_string_buffer(256)
    if library.gps_activate_preload(message, len(message)) != 0:  # no driver: no GPU here
        return None
    registry = Registry()
    atexit.register(uninstall)  # no call into Python while the interpreter goes away
    interpose.set_kernel_hooks(
        registry.on_module, registry.on_function, registry.on_unload, registry.on_launch,
        long_us,
    )  # fmt: skip
    _registry = registry
    frameworks.adopt_kernels(installed)  # kernels a framework links itself, unseen as PTX
    return registry


_report_sink: Callable[[str], None] | None = None


def report_to(sink: Callable[[str], None] | None) -> None:
    """Where a line on what the long kernels got goes as it changes (the session's
    control block, which the broker reads for ``gpushare status``); None: nowhere."""
    global _report_sink
    _report_sink = sink


def _report(line: str) -> None:
    sink = _report_sink
    if sink is not None:
        with contextlib.suppress(Exception):  # status is a courtesy: never fail a launch
            sink(line)


def installed() -> Registry | None:
    return _registry


def uninstall() -> None:
    global _registry
    interpose.clear_kernel_hooks()
    _registry = None


_as_is_seen: dict[str, int] = {}
# The shim's count of launches a Ctrl-C dropped, as far as a cell has said it already.
_dropped_told = [0]
#: Launches of a long kernel run as it is that the shim keeps on the GPU per thread
#: (``LONG_IN_FLIGHT`` in launch_interpose.c): what a Ctrl-C leaves to finish.
LONG_IN_FLIGHT = 2


def say_what_runs_as_is() -> list[str]:
    """After a cell: for each kind of launch in ``cell_lines.RUN_AS_IS`` the cell ran for the
    first time in this process, one line in the cell saying which protection applies
    and why.  Nothing where the shim is not preloaded (no counters)."""
    if _registry is None:
        return []
    try:
        counted = interpose.stats()
    except interpose.InterposerError:
        return []
    lines = []
    for kind in cell_lines.RUN_AS_IS:
        if counted.get(kind, 0) and kind not in _as_is_seen:
            _as_is_seen[kind] = counted[kind]
            line = cell_lines.run_as_is_line(kind)
            _registry.said.append(line)
            lines.append(line)
    dropped = counted.get("dropped", 0) - _dropped_told[0]
    if dropped > 0:
        _dropped_told[0] += dropped
        lines.append(dropped_line(dropped))
    for line in lines:
        _to_stderr(line)
    return lines


def dropped_line(dropped: int) -> str:
    """What a Ctrl-C did to launches of long kernels still waiting on the host."""
    launches = "launch" if dropped == 1 else "launches"
    return (
        f"gpushare: Ctrl-C dropped {dropped} {launches} of long kernels that waited on the "
        f"host (never run, so the next cell need not wait for them); at most "
        f"{LONG_IN_FLIGHT} already on the GPU finish first"
    )


def after_cell(result: Any = None) -> None:
    """IPython's post_run_cell hook: :func:`say_what_runs_as_is`, never raising."""
    with contextlib.suppress(Exception):
        say_what_runs_as_is()


def counts() -> dict[str, int]:
    """What the long kernels got so far in this process (empty without the registry):
    a cell's receipt shows the difference over the cell."""
    registry = _registry
    if registry is None:
        return {}
    twins = list(registry.twins.values())  # one C-level copy: no lock, no mid-change view
    made = [t for t in twins if t.analysed and t.kernel is not None]
    analysis_ns = sum(t.analysis_ns for t in twins)
    return {
        "preemptible": registry.launched, "yields": registry.yields,
        "aborts": registry.aborts, "saves": registry.saves,
        "unmodified": registry.fallbacks,
        "preemptible_ns": registry.preemptible_ns, "original_ns": registry.original_ns,
        # What making them preemptible cost: the analyses and transforms, and loading
        # the transformed modules (the driver's JIT, cached by it across processes).
        "made_preemptible": len(made), "preparation_ns": analysis_ns + _module_load_ns(),
    }  # fmt: skip


def _module_load_ns() -> int:
    if "gpushare_ext.kernels.driver" not in sys.modules:
        return 0
    return sys.modules["gpushare_ext.kernels.driver"].modules.load_ns


def summary() -> str:
    """A few words for the pause notice and status: what the long kernels got."""
    if _registry is None:
        return ""
    return cell_lines.long_kernels_summary(counts())
