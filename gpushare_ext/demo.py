"""``gpushare demo``: two real notebook sessions contend for one GPU on an embedded broker.

A low-priority training loop (``examples/training_low.ipynb``) starts first and holds
the GPU; a high-priority interactive cell (``examples/interactive_high.ipynb``) arrives
while it runs, is granted at once, and the training loop is paused until it is done.
Both run in real ipykernel kernels executed by nbclient.  The demo prints who waited,
who was preempted, the timings, and whether the preempted loop's result is
bit-identical to an undisturbed run.

A kernel takes seconds to start (2.5-3 s on a fresh clone), longer than the loop it
was meant to interrupt, so every notebook starts its kernel first and waits at its
``%%gpu`` cell: the demo then lets A in, and B in while A trains.  A demo that showed no
pause, or a result that differs, ends with a line that says so and exits 1.

With a GPU (NVML works and CuPy imports) the work is CuPy on the real device and the
pause is a real checkpoint lock; without one the broker simulates the shipped H200
readout and the loop's safe points hold it on the host.  The demo says which.

Whatever ends it -- its end, an error, Ctrl-C, SIGTERM or a closed terminal (SIGHUP) --
the demo stops the broker and the notebook kernels it started: those signals become
SystemExit while it runs, so its ``finally:`` runs, and kernels still running then are
shut down (they live in sessions of their own, where no terminal's signal reaches them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpushare_ext.broker.edges.launch import BrokerProcess, BrokerStartError
from gpushare_ext.errors import GpushareError
from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import LeaseState

if TYPE_CHECKING:  # nbformat is imported where a notebook is read: the CLI starts faster
    from nbformat import NotebookNode


def examples_dir() -> Path:
    checkout = Path(__file__).resolve().parents[1] / "examples"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parent / "examples"


# What the demo (and the tests) read back from an example, in a cell they add after the
# example's own: the examples print what a reader wants, this prints what a program wants.
RESULTS_CELLS = {
    "training_low.ipynb": (
        "print('checksum', checksum)\n"
        "print('timeline', [round(began, 4) for began, _ in step_times])"
    ),
    "interactive_high.ipynb": (
        "print('granted_at', started)\n"
        "print('latencies_ms', [round(s * 1e3, 3) for s in latencies])"
    ),
}


def load_example(name: str, parameters: dict):
    """An example notebook with its ``parameters`` cell replaced, and its results cell."""
    import nbformat
    from nbformat.v4 import new_code_cell

    notebook = nbformat.read(examples_dir() / name, as_version=4)
    for cell in notebook.cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cell.source = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
            break
    if name in RESULTS_CELLS:
        notebook.cells.append(new_code_cell(RESULTS_CELLS[name]))
    return notebook


def lease_cell(notebook) -> int:
    """The index of the example's ``%%gpu`` cell (what the broker paused or granted)."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and cell.source.startswith("%%gpu"):
            return index
    raise ValueError("the notebook has no %%gpu cell")


# The kernels running now, so that an interrupted demo can shut them down.
RUNNING_KERNELS: set = set()
KERNEL_FOLDERS: set[Path] = set()  # their channels' private folders, removed at the end
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# Every wait of the demo has an end.  A kernel takes 2-3 s to start on an idle 2-core
# machine, far more when three start at once beside a busy test run.
KERNELS_READY_TIMEOUT_S = 180.0
LEASE_GRANTED_TIMEOUT_S = 60.0
# Longer than a notebook's own cell timeout (600 s), which ends a stuck cell first.
NOTEBOOK_END_TIMEOUT_S = 900.0
# Past this, a notebook held at its %%gpu cell gives up on its own (the demo lets it in
# or cancels it long before; this only bounds a demo that vanished).
HELD_AT_LEASE_CELL_TIMEOUT_S = KERNELS_READY_TIMEOUT_S + NOTEBOOK_END_TIMEOUT_S


class DemoFailed(GpushareError):
    """The demo could not show what it is for; the message says what went wrong."""

    code = "demo_failed"


class LeaseCellGate:
    """Holds a notebook just before its ``%%gpu`` cell, until the demo lets it in.

    Its kernel has started and run the cells before (``%load_ext`` included) by then,
    so what the demo starts next is the cell alone: starting a kernel takes seconds, and
    a contender whose kernel was still starting missed the loop it was meant to preempt.
    """

    def __init__(self) -> None:
        self.reached = threading.Event()  # set by the notebook's thread at the gate
        self._opened = threading.Event()
        self._cancelled = False

    def hold(self, timeout: float = HELD_AT_LEASE_CELL_TIMEOUT_S) -> None:
        """In the notebook's thread: wait to be let in; raises DemoFailed if cancelled."""
        self.reached.set()
        if not self._opened.wait(timeout):
            raise DemoFailed(f"not let in to its %%gpu cell within {timeout:.0f} s")
        if self._cancelled:
            raise DemoFailed("the demo ended before this notebook's %%gpu cell ran")

    def let_in(self) -> None:
        self._opened.set()

    def cancel(self) -> None:
        """A notebook not let in yet gives up (one let in already goes on)."""
        if not self._opened.is_set():
            self._cancelled = True
            self._opened.set()


def execute_notebook(
    name: str, parameters: dict, *, timeout: int = 600, gate: LeaseCellGate | None = None
) -> NotebookNode:
    """Run an example notebook in a fresh kernel; returns the executed notebook.

    With a ``gate``, the notebook waits at its ``%%gpu`` cell until the gate lets it in.
    """
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    notebook = load_example(name, parameters)
    held_before = lease_cell(notebook) if gate is not None else None
    # IPC transport: the kernels' channels are Unix sockets in a private directory.
    ipc_dir = Path(tempfile.mkdtemp(prefix="gpushare-kernel-"))
    KERNEL_FOLDERS.add(ipc_dir)
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=str(ipc_dir / "kernel"))
    client = NotebookClient(notebook, km=manager, timeout=timeout, allow_errors=False)
    RUNNING_KERNELS.add(manager)
    try:
        # NotebookClient.execute() cell by cell, so that the gate can sit between two.
        client.reset_execution_trackers()
        with client.setup_kernel():
            for index, cell in enumerate(notebook.cells):
                if gate is not None and index == held_before:
                    gate.hold()
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
    finally:
        RUNNING_KERNELS.discard(manager)
        if manager.has_kernel:
            with contextlib.suppress(Exception):
                manager.shutdown_kernel(now=False)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        KERNEL_FOLDERS.discard(ipc_dir)
    return notebook


def error_line(error: BaseException | None) -> str:
    """What went wrong, in a line: a cell's exception as ``Name: value`` (nbclient's own
    message holds the whole coloured traceback), anything else as it reads."""
    ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
    if ename:
        return f"{ename}: {evalue}" if evalue else str(ename)
    return str(error)


class NotebookRun:
    """One example notebook executed on a thread of its own, held at its ``%%gpu`` cell."""

    def __init__(self, title: str, notebook_name: str, parameters: dict) -> None:
        self.title = title  # as the demo names it: "session A (low)"
        self.gate = LeaseCellGate()
        self.notebook: NotebookNode | None = None  # the executed notebook, once it ended well
        self.error: Exception | None = None
        self._name = notebook_name
        self._parameters = parameters
        # Daemon thread: an interrupted demo does not wait for its notebook to end.
        self.thread = threading.Thread(target=self._run, name=f"demo {title}", daemon=True)

    def _run(self) -> None:
        try:
            self.notebook = execute_notebook(self._name, self._parameters, gate=self.gate)
        except Exception as exc:  # reported by the demo; the other notebooks go on
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    def ended(self) -> bool:
        return self.thread.ident is not None and not self.thread.is_alive()

    def wait_until_ended(self, deadline: float) -> None:
        """Join its thread by ``deadline`` (monotonic); DemoFailed if it failed or hangs."""
        self.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            raise DemoFailed(f"{self.title} did not end within {NOTEBOOK_END_TIMEOUT_S:.0f} s")
        if self.error is not None:
            raise DemoFailed(f"{self.title} failed: {error_line(self.error)}")


def cell_text(notebook, index: int = -1) -> str:
    """All text a cell showed (streams, displays in their final form, results, errors)."""
    cell = notebook.cells[index]
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(str(output["data"].get("text/plain", "")))
        elif output.get("output_type") == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return "\n".join(parts)


def _value(text: str, key: str) -> str | None:
    for line in text.splitlines():
        if line.startswith(key + " "):
            return line[len(key) + 1 :].strip()
    return None


def _start_broker(workdir: Path, simulate: str | None) -> BrokerProcess:
    # Both sessions on one GPU: the demo is about contention.
    extra = () if simulate else ("--devices", "0")
    broker = BrokerProcess(workdir, simulate=simulate, log_level="warning", extra_args=extra)
    try:
        return broker.start()
    except BaseException as exc:  # not answering (or interrupted): it must not stay behind
        with contextlib.suppress(BrokerStartError):
            broker.stop(timeout=10)
        if isinstance(exc, BrokerStartError):
            raise RuntimeError(f"the demo broker did not start: {exc}") from None
        raise


def _gpu_usable() -> bool:
    probe = (
        "import cupy; cupy.cuda.runtime.getDeviceCount(); "
        "a = cupy.ones(4); assert float(a.sum()) == 4.0"
    )
    try:
        return (
            subprocess.run(
                [sys.executable, "-c", probe], capture_output=True, timeout=120
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


class Timeline:
    """Watches the broker and records every lease state change with its time."""

    def __init__(self, socket_path: Path) -> None:
        from gpushare_ext.client import BrokerClient

        self.client = BrokerClient(socket_path, client="cli")
        self.events: list[tuple[float, str, str, str]] = []
        self.waited: dict[str, float] = {}  # lease id -> seconds queued before its grant
        self._last: dict[str, str] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from gpushare_ext.client import BrokerError

        while not self._stop.is_set():
            try:
                snapshot = self.client.status()
            except BrokerError:
                return
            seen = set()
            for lease in snapshot.leases:
                seen.add(lease.lease_id)
                if lease.state != LeaseState.QUEUED:
                    self.waited.setdefault(lease.lease_id, lease.waited_s)
                if self._last.get(lease.lease_id) != lease.state.value:
                    self._last[lease.lease_id] = lease.state.value
                    self.events.append(
                        (snapshot.time, lease.lease_id, lease.state.value, lease.label)
                    )
            for lease_id in list(self._last):
                ended = LeaseState.RELEASED.value
                if lease_id not in seen and self._last[lease_id] != ended:
                    self._last[lease_id] = ended
                    self.events.append((time.time(), lease_id, ended, ""))
            time.sleep(0.05)

    def leases_in_order(self) -> list[str]:
        """The lease ids seen, in the order they first appeared."""
        return list(dict.fromkeys(lease_id for _, lease_id, _, _ in self.events))

    def state_of(self, lease_id: str) -> str | None:
        """The lease's last state seen (``released`` once gone), or None if never seen."""
        return self._last.get(lease_id)

    def was_preempted(self, lease_id: str) -> bool:
        held = {LeaseState.PAUSED.value, LeaseState.EVICTED.value}
        return any(lid == lease_id and state in held for _, lid, state, _ in self.events)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.client.close()


def inventory_problem(simulate: str) -> str | None:
    """Why ``--simulate`` names no inventory the broker could serve, or None."""
    from gpushare_ext.broker.hands.inventory import InventoryError, SimulatedInventory

    try:
        SimulatedInventory(simulate)
    except InventoryError as exc:
        return f"--simulate: {exc}"
    return None


def output_problem(out: Path) -> str | None:
    """Why the demo could not keep its results in ``out``, or None if it can.

    Found out by making the folder and a file in it, then removing what was made:
    permission bits cannot tell (root passes them, and /proc refuses root too).
    """
    made: list[Path] = []
    try:
        if out.exists() and not out.is_dir():
            return f"--out {out} is not a folder; give a folder to keep the results in"
        made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return (
            f"--out {out}: cannot write there ({exc.strerror or exc}); "
            "give a folder you can write to"
        )
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None


@contextlib.contextmanager
def _signals_end_the_demo():
    """While the demo runs, SIGTERM, SIGINT and SIGHUP raise SystemExit (a signal the
    caller ignores stays ignored); the first one counts, so the same signal sent again
    to the whole process group (as ``timeout`` does) cannot cut the cleanup short."""

    def end(signum: int, frame: object) -> None:
        for other in STOPPING_SIGNALS:
            signal.signal(other, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    before = {signum: signal.getsignal(signum) for signum in STOPPING_SIGNALS}
    for signum, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, end)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _stop_kernels() -> None:
    """Shut down the kernels still running (their notebooks then fail and end)."""
    for manager in list(RUNNING_KERNELS):
        with contextlib.suppress(Exception):
            manager.shutdown_kernel(now=True)
    for folder in list(KERNEL_FOLDERS):  # a notebook's thread ended early keeps none
        shutil.rmtree(folder, ignore_errors=True)
        KERNEL_FOLDERS.discard(folder)


def run_demo(*, simulate: str | None = None, steps: int = 40, out: str | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _run_demo(simulate=simulate, steps=steps, out=out)  # signals are not ours
    with _signals_end_the_demo():
        return _run_demo(simulate=simulate, steps=steps, out=out)


def _run_demo(*, simulate: str | None, steps: int, out: str | None) -> int:
    console = Console()
    refused = _refused_before_start(console, simulate, steps, out)
    if refused is not None:
        return refused
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-demo-"))
    os.chmod(workdir, 0o700)
    use_gpu = False
    if simulate is None:
        use_gpu = _gpu_usable()
        if not use_gpu:
            simulate = "h200"
    broker = _start_broker(workdir, simulate)
    socket_path = broker.socket
    os.environ["GPUSHARE_SOCKET"] = str(socket_path)
    try:
        _introduce(console, socket_path)
        low_params, high_params = _session_parameters(steps, use_gpu)
        timeline = Timeline(socket_path)
        try:
            contention = _contend(console, timeline, low_params, high_params, use_gpu)
        except DemoFailed as exc:
            _say_failed(console, str(exc))
            return 1
        finally:
            timeline.stop()
        report = _report(console, timeline, contention)
        if out:
            _write_outputs(console, Path(out), contention, report)
        if not report["low_paused"]:
            _say_failed(console, _why_no_pause(timeline, contention))
            return 1
        if not report["result_identical"]:
            _say_failed(
                console,
                "session A's result differs from the same loop run undisturbed: "
                "the pause lost or changed its data",
            )
            return 1
        return 0
    finally:
        _stop_kernels()
        with contextlib.suppress(BrokerStartError):
            broker.stop(timeout=10)
        os.environ.pop("GPUSHARE_SOCKET", None)
        shutil.rmtree(workdir, ignore_errors=True)  # its socket, journal and logs


def _say_failed(console: Console, why: str) -> None:
    """The demo's last line when it could not show what it is for.  ``why`` may quote a
    notebook's error: it is shown as text, never read as markup."""
    console.print(Text(f"gpushare demo: {plain_text(why, limit=SENTENCE_LIMIT)}", style="red"))


def _refused_before_start(
    console: Console, simulate: str | None, steps: int, out: str | None
) -> int | None:
    """The exit status for options the demo cannot run with, else None."""
    if steps < 4:
        console.print("[red]gpushare demo: --steps must be at least 4[/red]")
        return 2
    # Both before anything starts: a bad name or folder must not cost a whole demo run.
    problem = inventory_problem(simulate) if simulate else None
    if problem is None and out:
        problem = output_problem(Path(out))
    if problem:
        print(f"gpushare demo: {problem}", file=sys.stderr)
        return 2
    return None


def _introduce(console: Console, socket_path: Path) -> None:
    """The banner: where the broker listens and which device it serves, real or not."""
    from gpushare_ext.client import BrokerClient

    with BrokerClient(socket_path, client="cli") as client:
        snapshot = client.status()
    device = snapshot.devices[0].info
    where = "the real GPU" if not device.simulated else "a SIMULATED GPU (no GPU found)"
    console.rule("[bold]gpushare demo")
    console.print(f"embedded broker on {socket_path}; {snapshot.inventory_description}")
    console.print(
        f"device 0: {device.name}, {device.memory_total_mib} MiB, {device.multiprocessor_count} SMs -- {where}"
    )


def _session_parameters(steps: int, use_gpu: bool) -> tuple[dict, dict]:
    """The two notebooks' parameters: real-sized work on a GPU, small and paced without."""
    low_params = {
        "steps": steps * (GPU_STEPS_PER_STEP if use_gpu else 1),
        "step_seconds": 0.0 if use_gpu else SIMULATED_STEP_SECONDS,
        "size": 4096 if use_gpu else 256,
        "use_gpu": use_gpu,
        "seed": 7,
    }
    high_params = {"use_gpu": use_gpu, "repeats": 20, "size": 4096 if use_gpu else 512}
    return low_params, high_params


# Without a GPU a step of the training loop sleeps this long (the device time it stands
# for), so the default 40 steps take 2 s.  On a GPU, a step of ``--steps`` is this many
# products of the 4096 x 4096 layer with a 4096 x 64 batch, tens of microseconds each:
# 40 steps a step left the loop a fraction of a second on an H200, over before B came.
SIMULATED_STEP_SECONDS = 0.05
GPU_STEPS_PER_STEP = 1000
# How long session A trains before B's cell starts.  On a GPU, A's cell first imports
# CuPy, builds its arrays and starts cuBLAS: its whole cell of 320 products took 1.5 to
# 1.9 s on an H200.  Without one, a quarter of its loop, at most a second, so that A is
# seen training and most of its loop is left to pause.
GPU_HEAD_START_S = 2.0
SIMULATED_HEAD_START_S = 1.0


def head_start_s(low_params: dict, use_gpu: bool) -> float:
    """Seconds between session A's grant and session B's cell."""
    if use_gpu:
        return GPU_HEAD_START_S
    loop_s = low_params["steps"] * low_params["step_seconds"]
    return min(SIMULATED_HEAD_START_S, loop_s / 4)


@dataclass
class Contention:
    """What the two sessions and the reference run left: executed notebooks, lease ids
    and the moments the demo let each session in."""

    low: NotebookNode
    high: NotebookNode
    reference: NotebookNode
    low_lease: str
    high_lease: str | None  # None if the timeline never saw it
    low_started: float  # time.time() when session A's %%gpu cell was let in
    high_started: float  # ... and session B's
    kernels_ready_s: float  # from starting the kernels until each waited at its %%gpu cell


def _wait_for(condition: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _wait_until_all_held(runs: list[NotebookRun]) -> None:
    """Until every notebook waits at its ``%%gpu`` cell; DemoFailed if one ends first or
    the kernels take longer than KERNELS_READY_TIMEOUT_S."""

    def ended_early() -> list[NotebookRun]:
        return [run for run in runs if run.ended() and not run.gate.reached.is_set()]

    def all_held_or_one_ended() -> bool:
        return bool(ended_early()) or all(run.gate.reached.is_set() for run in runs)

    if not _wait_for(all_held_or_one_ended, KERNELS_READY_TIMEOUT_S):
        late = " and ".join(run.title for run in runs if not run.gate.reached.is_set())
        raise DemoFailed(
            f"the notebook kernels of {late} were not ready within "
            f"{KERNELS_READY_TIMEOUT_S:.0f} s; the machine may be too busy: run it again"
        )
    for run in ended_early():
        raise DemoFailed(f"{run.title} failed before its %%gpu cell: {error_line(run.error)}")


def _granted_lease(timeline: Timeline, low: NotebookRun) -> str:
    """Session A's lease, once the broker has granted it (the first lease it shows: B and
    the reference are still held at their cells); DemoFailed if that takes too long."""
    if not _wait_for(lambda: bool(timeline.leases_in_order()) or low.ended(),
                     LEASE_GRANTED_TIMEOUT_S):  # fmt: skip
        raise DemoFailed(f"session A's lease was not seen within {LEASE_GRANTED_TIMEOUT_S:.0f} s")
    if not timeline.leases_in_order():
        low.wait_until_ended(time.monotonic())  # says why it failed
        raise DemoFailed("session A ended before the broker showed its lease")
    lease = timeline.leases_in_order()[0]
    if not _wait_for(lambda: timeline.state_of(lease) != LeaseState.QUEUED.value,
                     LEASE_GRANTED_TIMEOUT_S):  # fmt: skip
        raise DemoFailed(
            f"session A's lease {lease} was not granted within {LEASE_GRANTED_TIMEOUT_S:.0f} s"
        )
    return lease


def _contend(
    console: Console, timeline: Timeline, low_params: dict, high_params: dict, use_gpu: bool
) -> Contention:
    """Session A's cell runs, session B's arrives while A trains; then the same loop runs
    again alone, for reference.  All three kernels start first and wait at their
    ``%%gpu`` cells, so that B arrives when the demo says, whatever a kernel's start
    takes.  DemoFailed says what went wrong."""
    low = NotebookRun("session A (low)", "training_low.ipynb", low_params)
    high = NotebookRun("session B (high)", "interactive_high.ipynb", high_params)
    reference = NotebookRun("the reference run", "training_low.ipynb", low_params)
    runs = [low, high, reference]
    console.print("starting the notebook kernels of sessions A and B and of a reference run ...")
    began = time.monotonic()
    for run in runs:
        run.start()
    try:
        _wait_until_all_held(runs)
        kernels_ready_s = time.monotonic() - began
        console.print(f"kernels ready in {kernels_ready_s:.1f} s; each waits at its %%gpu cell")
        console.print("session A (priority low): training loop starts ...")
        low_started = time.time()
        low.gate.let_in()
        low_lease = _granted_lease(timeline, low)
        # A trains for its head start; should its loop end sooner, B has nothing to
        # preempt, and waiting on would only hide that.
        _wait_for(lambda: timeline.state_of(low_lease) != LeaseState.RUNNING.value,
                  head_start_s(low_params, use_gpu))  # fmt: skip
        if timeline.state_of(low_lease) != LeaseState.RUNNING.value:
            raise DemoFailed(
                f"session A's lease was {timeline.state_of(low_lease)} before session B's "
                "cell started: nothing left to preempt; run it with more --steps"
            )
        console.print("session B (priority high): interactive cell arrives ...")
        high_started = time.time()
        high.gate.let_in()
        deadline = time.monotonic() + NOTEBOOK_END_TIMEOUT_S
        high.wait_until_ended(deadline)
        low.wait_until_ended(deadline)
        high_lease = next((lid for lid in timeline.leases_in_order() if lid != low_lease), None)
        # The reference starts once both have ended: it runs undisturbed, as it must.
        console.print("reference: the same training loop alone, undisturbed ...")
        reference.gate.let_in()
        reference.wait_until_ended(time.monotonic() + NOTEBOOK_END_TIMEOUT_S)
    finally:
        for run in runs:  # those still held at their %%gpu cell give up
            run.gate.cancel()
    return Contention(
        low=low.notebook,
        high=high.notebook,
        reference=reference.notebook,
        low_lease=low_lease,
        high_lease=high_lease,
        low_started=low_started,
        high_started=high_started,
        kernels_ready_s=kernels_ready_s,
    )


def _why_no_pause(timeline: Timeline, contention: Contention) -> str:
    """The one line a demo that showed no pause ends with: what the broker saw instead."""
    if timeline.was_preempted(contention.low_lease):
        why = "the broker paused its lease, but its cell did not say so"
    elif contention.high_lease is None:
        why = "the broker never showed session B's lease"
    else:
        low_end = _first_time(timeline, contention.low_lease, LeaseState.RELEASED)
        high_grant = _first_time(timeline, contention.high_lease, LeaseState.RUNNING)
        if low_end is not None and (high_grant is None or low_end <= high_grant):
            why = "its loop ended before session B's lease was granted"
        else:
            why = "session B's lease was granted while A's ran, and A's was left running"
    return (
        f"no preemption shown: session A (low) was not paused for session B (high): {why}. "
        "Run it again, or with more --steps"
    )


def _first_time(timeline: Timeline, lease_id: str, state: LeaseState) -> float | None:
    return next(
        (at for at, lid, seen, _ in timeline.events if lid == lease_id and seen == state.value),
        None,
    )


def _write_outputs(console: Console, target: Path, contention: Contention, report: dict) -> None:
    """The executed notebooks and the timeline, for ``--out``."""
    target.mkdir(parents=True, exist_ok=True)
    import nbformat

    nbformat.write(contention.low, target / "session-a-low.ipynb")
    nbformat.write(contention.high, target / "session-b-high.ipynb")
    (target / "timeline.json").write_text(json.dumps(report, indent=2))
    console.print(f"executed notebooks and timeline in {target}")


def _session_of(lease_id: str, contention: Contention) -> str:
    if lease_id == contention.low_lease:
        return "A (low)"
    if lease_id == contention.high_lease:
        return "B (high)"
    return ""


def _events_table(events: list[tuple[float, str, str, str]], contention: Contention) -> Table:
    table = Table(title="what happened")
    table.add_column("s after A's cell", justify="right")
    for column in ("lease", "session", "state"):
        table.add_column(column)
    for at, lease_id, state, _label in events:
        session = _session_of(lease_id, contention)
        table.add_row(f"{at - contention.low_started:.2f}", lease_id, session, state)
    return table


def _summary_table(
    queue_wait: float | None,
    cell_to_work_s: float,
    latencies: list[float],
    pauses: list[str],
    same: bool,
) -> Table:
    # Rows of a name and a figure: no header row, which would only be empty.
    summary = Table(title="summary", show_header=False)
    summary.add_column("what")
    summary.add_column("figure")
    if queue_wait is not None:
        summary.add_row("session B (high) waited in the queue", f"{queue_wait * 1e3:.1f} ms")
    summary.add_row("session B from its cell's start to its work", f"{cell_to_work_s:.2f} s")
    if latencies:
        ordered = sorted(latencies)
        summary.add_row(
            "session B request latency p50 / max",
            f"{ordered[len(ordered) // 2]:.2f} / {ordered[-1]:.2f} ms",
        )
    summary.add_row(
        "session A (low) preempted",
        # The cell's own line: text, never markup (it names the user who preempted).
        Text("yes: " + pauses[0].removeprefix("gpushare: ")) if pauses else "NO",
    )
    summary.add_row(
        "session A result identical to an undisturbed run", "yes (sha256 match)" if same else "NO"
    )
    return summary


def _report(console: Console, timeline: Timeline, contention: Contention) -> dict:
    """Print the events and the summary; returns them for ``--out``."""
    events = [event for event in timeline.events if _session_of(event[1], contention)]
    console.print(_events_table(events, contention))
    low_text = cell_text(contention.low, lease_cell(contention.low))
    high_text = cell_text(contention.high)
    pauses = [line for line in low_text.splitlines() if "paused for a higher-priority" in line]
    resumes = [line for line in low_text.splitlines() if "resumed after" in line]
    queue_wait = timeline.waited.get(contention.high_lease) if contention.high_lease else None
    latencies = json.loads(_value(high_text, "latencies_ms") or "[]")
    granted_at = float(_value(high_text, "granted_at") or contention.high_started)
    cell_to_work_s = granted_at - contention.high_started
    checksum = _value(cell_text(contention.low), "checksum")
    same = checksum is not None and checksum == _value(cell_text(contention.reference), "checksum")
    console.print(_summary_table(queue_wait, cell_to_work_s, latencies, pauses, same))
    return {
        "events": [
            {"t": at - contention.low_started, "lease": lid, "state": st, "cell": label}
            for at, lid, st, label in events
        ],
        "kernels_ready_s": contention.kernels_ready_s,
        "high_queue_wait_s": queue_wait,
        "high_cell_to_work_s": cell_to_work_s,
        "high_latencies_ms": latencies,
        "low_paused": bool(pauses),
        "low_resumed": resumes[-1] if resumes else None,
        "result_identical": same,
    }
