"""``gpushare demo``: two real notebook sessions contend for one GPU on an embedded broker.

A low-priority training loop (``examples/training_low.ipynb``) starts first and holds
the GPU; a high-priority interactive cell (``examples/interactive_high.ipynb``) arrives
while it runs, is granted at once, and the training loop is paused until it is done.
Both run in real ipykernel kernels executed by nbclient.  The demo prints who waited,
who was preempted, the timings, and whether the preempted loop's result is
bit-identical to an undisturbed run.

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
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpushare_ext.broker.launch import BrokerProcess, BrokerStartError
from gpushare_ext.protocol import LeaseState


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


def execute_notebook(name: str, parameters: dict, *, timeout: int = 600):
    """Run an example notebook in a fresh kernel; returns the executed notebook."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    notebook = load_example(name, parameters)
    # IPC transport: the kernels' channels are Unix sockets in a private directory.
    ipc_dir = Path(tempfile.mkdtemp(prefix="gpushare-kernel-"))
    KERNEL_FOLDERS.add(ipc_dir)
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=str(ipc_dir / "kernel"))
    client = NotebookClient(notebook, km=manager, timeout=timeout, allow_errors=False)
    RUNNING_KERNELS.add(manager)
    try:
        client.execute()
    finally:
        RUNNING_KERNELS.discard(manager)
        if manager.has_kernel:
            with contextlib.suppress(Exception):
                manager.shutdown_kernel(now=False)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        KERNEL_FOLDERS.discard(ipc_dir)
    return notebook


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

    def running_low(self) -> bool:
        return any(state == LeaseState.RUNNING.value for _, _, state, _ in self.events)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.client.close()


def inventory_problem(simulate: str) -> str | None:
    """Why ``--simulate`` names no inventory the broker could serve, or None."""
    from gpushare_ext.broker.inventory import InventoryError, SimulatedInventory

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
        results, started, high_started = _contend(
            console, timeline, low_params, high_params, use_gpu
        )
        failures = {k: v for k, v in results.items() if isinstance(v, Exception)}
        if failures:
            for key, exc in failures.items():
                console.print(f"[red]session {key} failed: {exc}[/red]")
            return 1
        console.print("reference: the same training loop alone, undisturbed ...")
        reference = execute_notebook("training_low.ipynb", low_params)
        low_nb, high_nb = results["low"], results["high"]
        low_text = cell_text(low_nb, lease_cell(low_nb))
        high_text = cell_text(high_nb)
        same = _value(cell_text(low_nb), "checksum") == _value(cell_text(reference), "checksum")
        report = _report(console, timeline, started, high_started, low_text, high_text, same)
        if out:
            _write_outputs(console, Path(out), results, report)
        return 0 if same else 1
    finally:
        _stop_kernels()
        with contextlib.suppress(BrokerStartError):
            broker.stop(timeout=10)
        os.environ.pop("GPUSHARE_SOCKET", None)
        shutil.rmtree(workdir, ignore_errors=True)  # its socket, journal and logs


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
        "steps": steps * (40 if use_gpu else 1),
        "step_seconds": 0.0 if use_gpu else 0.05,
        "size": 4096 if use_gpu else 256,
        "use_gpu": use_gpu,
        "seed": 7,
    }
    high_params = {"use_gpu": use_gpu, "repeats": 20, "size": 4096 if use_gpu else 512}
    return low_params, high_params


def _contend(
    console: Console, timeline: Timeline, low_params: dict, high_params: dict, use_gpu: bool
) -> tuple[dict[str, object], float, float]:
    """The low session starts, the high one arrives once the low one runs; returns each
    session's notebook (or its exception), when the low and the high one started."""
    results: dict[str, object] = {}

    def run(name: str, key: str, parameters: dict) -> None:
        try:
            results[key] = execute_notebook(name, parameters)
        except Exception as exc:  # reported below; the other session keeps going
            results[key] = exc

    console.print("session A (priority low): training loop starts ...")
    started = time.time()
    # Daemon threads: an interrupted demo does not wait for its notebooks to end.
    low = threading.Thread(target=run, args=("training_low.ipynb", "low", low_params), daemon=True)
    low.start()
    deadline = time.monotonic() + 120
    while not timeline.running_low() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0 if not use_gpu else 2.0)
    console.print("session B (priority high): interactive cell arrives ...")
    high_started = time.time()
    high = threading.Thread(
        target=run, args=("interactive_high.ipynb", "high", high_params), daemon=True
    )
    high.start()
    high.join()
    low.join()
    timeline.stop()
    return results, started, high_started


def _write_outputs(
    console: Console, target: Path, results: dict[str, object], report: dict
) -> None:
    """The executed notebooks and the timeline, for ``--out``."""
    target.mkdir(parents=True, exist_ok=True)
    import nbformat

    nbformat.write(results["low"], target / "session-a-low.ipynb")  # type: ignore[arg-type]
    nbformat.write(results["high"], target / "session-b-high.ipynb")  # type: ignore[arg-type]
    (target / "timeline.json").write_text(json.dumps(report, indent=2))
    console.print(f"executed notebooks and timeline in {target}")


def _events_table(events: list[tuple[float, str, str, str]], started: float) -> Table:
    table = Table(title="what happened (seconds from the start)")
    for column in ("t", "lease", "state", "cell"):
        table.add_column(column)
    for at, lease_id, state, label in events:
        table.add_row(f"{at - started:6.2f}", lease_id, state, label[:50])
    return table


def _high_queue_wait(timeline: Timeline) -> float | None:
    """How long the high session's lease queued: its cell is the one that imports
    ``time`` but not ``hashlib`` (the low session's cell does both)."""
    events = timeline.events
    high_leases = [
        lid
        for _, lid, _, label in events
        if label.startswith("import time") and lid in timeline.waited
    ]
    low_leases = {lid for _, lid, _, label in events if "hashlib" in label}
    high_lease = next((lid for lid in high_leases if lid not in low_leases), None)
    return timeline.waited.get(high_lease) if high_lease else None


def _summary_table(
    queue_wait: float | None,
    start_to_run_s: float,
    latencies: list[float],
    pauses: list[str],
    same: bool,
) -> Table:
    summary = Table(title="summary")
    summary.add_column("")
    summary.add_column("")
    if queue_wait is not None:
        summary.add_row("session B (high) waited in the queue", f"{queue_wait * 1e3:.1f} ms")
    summary.add_row("session B from kernel start to its cell running", f"{start_to_run_s:.2f} s")
    if latencies:
        ordered = sorted(latencies)
        summary.add_row(
            "session B request latency p50 / max",
            f"{ordered[len(ordered) // 2]:.2f} / {ordered[-1]:.2f} ms",
        )
    summary.add_row(
        "session A (low) preempted",
        "yes: " + pauses[0].removeprefix("gpushare: ") if pauses else "no",
    )
    summary.add_row(
        "session A result identical to an undisturbed run", "yes (sha256 match)" if same else "NO"
    )
    return summary


def _report(
    console: Console,
    timeline: Timeline,
    started: float,
    high_started: float,
    low_text: str,
    high_text: str,
    same: bool,
) -> dict:
    events = timeline.events
    console.print(_events_table(events, started))
    pauses = [line for line in low_text.splitlines() if "paused for a higher-priority" in line]
    resumes = [line for line in low_text.splitlines() if "resumed after" in line]
    queue_wait = _high_queue_wait(timeline)
    latencies = json.loads(_value(high_text, "latencies_ms") or "[]")
    granted_at = float(_value(high_text, "granted_at") or high_started)
    console.print(_summary_table(queue_wait, granted_at - high_started, latencies, pauses, same))
    return {
        "events": [
            {"t": at - started, "lease": lid, "state": st, "cell": lb} for at, lid, st, lb in events
        ],
        "high_queue_wait_s": queue_wait,
        "high_kernel_start_to_run_s": granted_at - high_started,
        "high_latencies_ms": latencies,
        "low_paused": bool(pauses),
        "low_resumed": resumes[-1] if resumes else None,
        "result_identical": same,
    }
