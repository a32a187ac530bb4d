"""Helpers of the notebook-runtime tests: a real broker, real ipykernel kernels, nbclient.

Everything here is what a user has: ``gpushare broker --simulate h200`` in a subprocess
(its own socket and journal in a short temporary directory), kernels started by
jupyter_client over IPC transport (Unix sockets, no TCP ports), and the example notebooks
executed by nbclient with their ``parameters`` cell replaced, as ``gpushare demo`` does.

* :class:`BrokerProcess` / :func:`start_broker_process` -- a broker you can stop and restart
  (the ``broker`` fixture is one per test module; see conftest.py).
* :class:`NotebookKernel` -- a kernel whose cells run in the background; every text a cell
  shows is recorded *as it was shown* (a live line later replaced, like the queue line, stays
  in :attr:`CellRun.shown`), next to the cell's final output (:meth:`CellRun.final_text`).
* :func:`run_example` -- an ``examples/*.ipynb`` notebook under nbclient, recording the same.
* :func:`wait_for` -- polling with a generous deadline and a message saying what was awaited.

Waits poll with generous deadlines: CI machines are small and loaded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from support import remove_sessions_left_by

from gpushare_ext.broker.edges import launch
from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import LeaseView, Snapshot

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BROKER_START_S = 30.0
KERNEL_START_S = 90.0
CELL_TIMEOUT_S = 60.0
ME = pwd.getpwuid(os.getuid()).pw_name


def short_tempdir(prefix: str = "gps-rt-") -> Path:
    """A fresh directory under /tmp (Unix socket paths must stay under 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 30.0, every=0.05):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


# ------------------------------------------------------------------ broker


@dataclass
class BrokerProcess(launch.BrokerProcess):
    """A ``gpushare broker`` subprocess the tests can stop and start again (same socket,
    same journal); failures are test failures."""

    socket_name: str = "b.sock"
    log_level: str = "info"

    def start(self) -> BrokerProcess:  # type: ignore[override]
        try:
            super().start(timeout=BROKER_START_S)
        except launch.BrokerStartError as exc:
            raise AssertionError(str(exc)) from None
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        try:
            return super().stop(sig, timeout)
        except launch.BrokerStartError as exc:
            raise AssertionError(str(exc)) from None

    def status(self) -> Snapshot:
        with BrokerClient(self.socket, client="cli", connect_timeout=5) as client:
            return client.status()

    def leases(self) -> list[LeaseView]:
        return list(self.status().leases)

    def leases_of(self, pid: int) -> list[LeaseView]:
        return [lease for lease in self.leases() if lease.pid == pid]

    def log_tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:] or "(no broker log)"


def start_broker_process(
    config_toml: str | None = None, simulate: str | None = "h200"
) -> BrokerProcess:
    return BrokerProcess(short_tempdir(), simulate=simulate, config_toml=config_toml).start()


def dispose_broker(broker: BrokerProcess) -> None:
    with contextlib.suppress(AssertionError):
        broker.stop()
    remove_sessions_left_by(broker.socket)  # a broker the test killed left its directory
    shutil.rmtree(broker.directory, ignore_errors=True)


# ------------------------------------------------------------------ kernels


def _texts_of(msg_type: str, content: dict) -> str | None:
    if msg_type == "stream":
        return content.get("text", "")
    if msg_type in ("display_data", "update_display_data", "execute_result"):
        return str(content.get("data", {}).get("text/plain", ""))
    if msg_type == "error":
        return f"{content.get('ename')}: {content.get('evalue')}"
    return None


@dataclass
class CellRun:
    """One cell executing in a :class:`NotebookKernel`; filled in by the kernel's readers."""

    code: str
    msg_id: str = ""
    shown: list[tuple[float, str]] = field(default_factory=list)  # every text, when shown
    outputs: list[dict] = field(default_factory=list)  # the final output area
    reply: dict | None = None
    idle: bool = False
    finished_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)

    # ---- what the user saw

    def final_text(self) -> str:
        parts = []
        for output in self.outputs:
            if output["kind"] == "stream":
                parts.append(output["text"])
            else:
                parts.append(output["text"] + "\n")
        return "".join(parts)

    def shown_text(self) -> str:
        return "\n".join(text for _, text in self.shown)

    def stdout_value(self, key: str) -> str | None:
        """The rest of the printed line ``key ...`` (like ``print('checksum', x)``)."""
        for line in self.final_text().splitlines():
            if line.startswith(key + " "):
                return line[len(key) + 1 :].strip()
        return None

    @property
    def stderr(self) -> str:
        return "".join(o["text"] for o in self.outputs if o.get("name") == "stderr")

    @property
    def status(self) -> str | None:
        """``ok`` or ``error`` (``error`` also for a UsageError, which IPython prints)."""
        return (self.reply or {}).get("status")

    @property
    def error(self) -> dict | None:
        for output in self.outputs:
            if output["kind"] == "error":
                return output
        return None

    @property
    def pages(self) -> list[str]:
        """Texts IPython paged (``%%gpu?``): they come in the execute reply's payload."""
        payloads = (self.reply or {}).get("payload", [])
        return [str(p.get("data", {}).get("text/plain", "")) for p in payloads]

    def describe(self) -> str:
        return (
            f"--- cell ---\n{self.code}\n--- final output ---\n{self.final_text()}"
            f"\n--- every text shown ---\n{self.shown_text()}\n--- reply status: "
            f"{(self.reply or {}).get('status')} ---"
        )

    # ---- waiting

    def wait(self, timeout: float = CELL_TIMEOUT_S) -> CellRun:
        if not self.done.wait(timeout):
            raise AssertionError(f"the cell did not finish within {timeout} s\n{self.describe()}")
        return self

    def wait_shown(self, text: str, timeout: float = 30.0) -> str:
        """Wait until some text containing ``text`` was shown; return that text."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for _, shown in self.shown:
                    if text in shown:
                        return shown
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.done.is_set():
                    raise AssertionError(f"the cell never showed {text!r}\n{self.describe()}")
                self.changed.wait(min(remaining, 0.2))

    def ok(self, timeout: float = CELL_TIMEOUT_S) -> CellRun:
        """Wait for the cell and require that it ended without an error."""
        self.wait(timeout)
        if self.error is not None or (self.reply or {}).get("status") != "ok":
            raise AssertionError(f"the cell failed\n{self.describe()}")
        return self

    # ---- fed by the readers

    def _record(self, msg_type: str, content: dict) -> None:
        text = _texts_of(msg_type, content)
        with self.changed:
            if text is not None:
                self.shown.append((time.time(), text))
            display_id = (content.get("transient") or {}).get("display_id")
            if msg_type == "update_display_data":
                for output in self.outputs:
                    if output.get("display_id") == display_id:
                        output["text"] = text
            elif msg_type == "stream":
                last = self.outputs[-1] if self.outputs else None
                if last and last["kind"] == "stream" and last["name"] == content.get("name"):
                    last["text"] += text or ""
                else:
                    self.outputs.append(
                        {"kind": "stream", "name": content.get("name"), "text": text or ""}
                    )
            elif msg_type == "clear_output":
                self.outputs.clear()
            elif text is not None:
                entry = {"kind": "error" if msg_type == "error" else "data", "text": text}
                if msg_type == "error":
                    entry.update(
                        ename=content.get("ename"),
                        evalue=content.get("evalue"),
                        traceback="\n".join(content.get("traceback", [])),
                    )
                if display_id:
                    entry["display_id"] = display_id
                self.outputs.append(entry)
            self.changed.notify_all()

    def _finish_if_complete(self) -> None:
        if self.idle and self.reply is not None and not self.done.is_set():
            self.finished_at = time.time()
            self.done.set()
            with self.changed:
                self.changed.notify_all()


class NotebookKernel:
    """A real ipykernel process driven by jupyter_client over IPC transport."""

    def __init__(self, name: str, env: dict[str, str] | None = None) -> None:
        from jupyter_client.manager import KernelManager

        self.name = name
        self.ipc_dir = short_tempdir("gps-k-")
        self.manager = KernelManager(
            kernel_name="python3", transport="ipc", ip=str(self.ipc_dir / "kernel")
        )
        self.manager.start_kernel(env=dict(os.environ if env is None else env))
        self.client = None
        self.runs: dict[str, CellRun] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []
        self.pid = 0

    def ready(self) -> NotebookKernel:
        client = self.manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=KERNEL_START_S)
        self.client = client
        for channel in ("iopub", "shell"):
            reader = threading.Thread(
                target=self._read, args=(channel,), name=f"{self.name}-{channel}", daemon=True
            )
            reader.start()
            self._readers.append(reader)
        self.pid = int(self.run("import os; print(os.getpid())").ok().final_text().strip())
        return self

    def _read(self, channel: str) -> None:
        get = getattr(self.client, f"get_{channel}_msg")
        while not self._stop.is_set():
            try:
                message = get(timeout=0.2)
            except Exception:  # queue.Empty, or the channel closed at shutdown
                if not self.manager.has_kernel and self._stop.is_set():
                    return
                continue
            parent = message.get("parent_header", {}).get("msg_id")
            with self._lock:
                run = self.runs.get(parent)
            if run is None:
                continue
            msg_type = message["msg_type"]
            content = message["content"]
            if channel == "shell":
                if msg_type == "execute_reply":
                    run.reply = content
                    run._finish_if_complete()
                continue
            if msg_type == "status":
                if content.get("execution_state") == "idle":
                    run.idle = True
                    run._finish_if_complete()
                continue
            run._record(msg_type, content)

    def submit(self, code: str) -> CellRun:
        """Start running ``code`` as a cell; returns at once."""
        assert self.client is not None, "call ready() first"
        run = CellRun(code=code)
        with self._lock:
            run.msg_id = self.client.execute(code, allow_stdin=False)
            self.runs[run.msg_id] = run
        return run

    def run(self, code: str, timeout: float = CELL_TIMEOUT_S) -> CellRun:
        """Run ``code`` as a cell and wait for it to end (with or without an error)."""
        return self.submit(code).wait(timeout)

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()

    def kill(self) -> None:
        """SIGKILL the kernel process: no cleanup code of the kernel runs."""
        os.kill(self.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        self._stop.set()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.stop_channels()
        with contextlib.suppress(Exception):
            if self.manager.has_kernel:
                self.manager.shutdown_kernel(now=True)
        for reader in self._readers:
            reader.join(timeout=2)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def preloaded_env(fake_driver: Path, **extra: str) -> dict[str, str]:
    """The environment of a process with the launch shim preloaded in front of the
    stand-in driver in ``fake_driver`` (as a kernel the server extension starts), this
    checkout importable, the interposer setting left to its default, and ``extra``."""
    from gpushare_ext.runtime import interpose

    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(interpose.NATIVE),
        LD_LIBRARY_PATH=str(fake_driver),
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
        **extra,
    )
    env.pop("GPUSHARE_INTERPOSER", None)
    return env


# The start of code run with the launch shim preloaded in front of the stand-in driver:
# ``entry(name, kind)`` gets a driver entry point as CUDA's runtime does (through
# cuGetProcAddress, whose answer the shim wraps); ``u`` and ``p`` are ctypes' unsigned int
# and void pointer, ``cuda`` the driver library.
DRIVER_ENTRIES = r"""
import ctypes
u, p = ctypes.c_uint, ctypes.c_void_p
cuda = ctypes.CDLL("libcuda.so.1")
get_proc = cuda.cuGetProcAddress_v2
get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(p), ctypes.c_int, ctypes.c_uint64, p]
def entry(name, kind):
    found = p()
    assert get_proc(name, ctypes.byref(found), 12080, 0, None) == 0
    return kind(found.value)
"""


def holding_cell(release_file: Path, priority: str = "high", extra: str = "") -> str:
    """A ``%%gpu`` cell that holds its lease until ``release_file`` exists (at most 120 s)."""
    return (
        f"%%gpu priority={priority} {extra}\n"
        "import os, time\n"
        "print('holding since', time.time(), flush=True)\n"
        "deadline = time.time() + 120\n"
        f"while not os.path.exists({str(release_file)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.02)\n"
        "print('released at', time.time(), flush=True)\n"
    )


# ------------------------------------------------------------------ example notebooks


def load_example(name: str, parameters: dict, gpu_line: str | None = None):
    """An example notebook with its ``parameters`` cell replaced and the results cell
    after it, as ``gpushare demo`` runs it.

    ``gpu_line`` replaces the ``%%gpu ...`` line of its lease cell (to ask for other sizes).
    """
    from gpushare_ext.demo import lease_cell
    from gpushare_ext.demo import load_example as load

    notebook = load(name, parameters)
    tagged = [c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert tagged, f"{name} has no cell tagged 'parameters'"
    if gpu_line is not None:
        cell = notebook.cells[lease_cell(notebook)]
        cell.source = gpu_line + cell.source[cell.source.index("\n") :]
    return notebook


@dataclass
class ExampleRun:
    """An example notebook running under nbclient in a thread, recorded as it runs."""

    name: str
    notebook: object
    shown: list[tuple[float, int, str]] = field(default_factory=list)  # (time, cell, text)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    manager: object = None
    thread: threading.Thread | None = None

    @property
    def kernel_pid(self) -> int | None:
        process = getattr(getattr(self.manager, "provisioner", None), "process", None)
        return getattr(process, "pid", None)

    def shown_in(self, cell: int) -> str:
        return "\n".join(text for _, index, text in self.shown if index == cell)

    def wait_shown(self, text: str, timeout: float = 60.0) -> str:
        def found():
            for _, _, shown in list(self.shown):
                if text in shown:
                    return shown
            if self.done.is_set():
                raise AssertionError(
                    f"{self.name} ended without showing {text!r}\n{self.describe()}"
                )
            return None

        return wait_for(found, f"{self.name} to show {text!r}", timeout)

    def wait(self, timeout: float = 120.0) -> ExampleRun:
        if not self.done.wait(timeout):
            raise AssertionError(
                f"{self.name} did not finish within {timeout} s\n{self.describe()}"
            )
        if self.error is not None:
            raise AssertionError(f"{self.name} failed: {self.error}\n{self.describe()}")
        return self

    def cell_text(self, index: int | None = None) -> str:
        """The final output of a cell (by default the ``%%gpu`` cell), as saved in the
        executed notebook."""
        from gpushare_ext.demo import lease_cell

        if index is None:
            index = lease_cell(self.notebook)
        cell = self.notebook.cells[index]  # type: ignore[attr-defined]
        parts = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output.get("text", ""))
            elif "data" in output:
                parts.append(str(output["data"].get("text/plain", "")) + "\n")
            elif output.get("output_type") == "error":
                parts.append(f"{output.get('ename')}: {output.get('evalue')}\n")
        return "".join(parts)

    def value(self, key: str, index: int = -1) -> str | None:
        """What the results cell (the last one) printed after ``key``."""
        for line in self.cell_text(index).splitlines():
            if line.startswith(key + " "):
                return line[len(key) + 1 :].strip()
        return None

    def describe(self) -> str:
        lines = [f"--- {self.name}: every text shown ---"]
        lines += [f"[cell {index}] {text.rstrip()}" for _, index, text in self.shown]
        return "\n".join(lines)


def example_cells(name: str, parameters: dict, gpu_line: str | None = None) -> list[str]:
    """The code cells of an example notebook, to run one by one in a :class:`NotebookKernel`."""
    notebook = load_example(name, parameters, gpu_line)
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def run_example(
    name: str, parameters: dict, *, timeout: int = 180, gpu_line: str | None = None
) -> ExampleRun:
    """Start ``examples/<name>`` in a fresh kernel under nbclient; returns at once."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    record = ExampleRun(name=name, notebook=load_example(name, parameters, gpu_line))

    class RecordingClient(NotebookClient):
        def process_message(self, msg, cell, cell_index):  # every output, live, and updates
            text = _texts_of(msg["msg_type"], msg["content"])
            if text is not None:
                record.shown.append((time.time(), cell_index, text))
            return super().process_message(msg, cell, cell_index)

    def execute() -> None:
        ipc_dir = short_tempdir("gps-nb-")
        manager = KernelManager(kernel_name="python3", transport="ipc", ip=str(ipc_dir / "k"))
        client = RecordingClient(
            record.notebook, km=manager, timeout=timeout, allow_errors=False,
            startup_timeout=KERNEL_START_S,
        )  # fmt: skip
        record.manager = manager
        try:
            client.execute()
        except BaseException as exc:
            record.error = exc
        finally:
            with contextlib.suppress(Exception):
                if manager.has_kernel:
                    manager.shutdown_kernel(now=True)
            shutil.rmtree(ipc_dir, ignore_errors=True)
            record.done.set()

    record.thread = threading.Thread(target=execute, name=f"nbclient-{name}", daemon=True)
    record.thread.start()
    return record


def reference_checksum(parameters: dict) -> str:
    """The training loop of examples/training_low.ipynb run here, alone, without a lease."""
    from gpushare_ext.demo import lease_cell

    notebook = load_example("training_low.ipynb", parameters)
    source = notebook.cells[lease_cell(notebook)].source
    body = "\n".join(line for line in source.splitlines() if not line.startswith("%%gpu"))
    namespace: dict = dict(parameters)
    namespace["step_seconds"] = 0.0  # time does not enter the result
    import contextlib as _c
    import io

    printed = io.StringIO()
    with _c.redirect_stdout(printed):
        exec(compile(body, "training_low.ipynb", "exec"), namespace)
    return namespace["checksum"]


def cli_status_json(socket_path: Path) -> dict:
    """``gpushare status --json`` as a user would run it."""
    done = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "status", "--json", "--socket", str(socket_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, f"gpushare status failed: {done.stderr}"
    return json.loads(done.stdout)


@functools.lru_cache(maxsize=2)
def gpu_missing_reason(need: int = 1) -> str | None:
    """Why the GPU tests here cannot run (None: ``need`` GPUs with CuPy are there)."""
    probe = (
        "import cupy, sys; count = cupy.cuda.runtime.getDeviceCount()\n"
        f"if count < {need}: sys.exit(f'{{count}} GPU here: these tests need {need}')"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no usable GPU: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        if "GPU here" in last:
            return last
        return f"no usable GPU (CuPy could not count devices: {last})"
    return None


def loaded(kernels: Callable[..., list[NotebookKernel]], count: int) -> list[NotebookKernel]:
    """``count`` real kernels (from the ``kernels`` fixture) with ``%load_ext gpushare_ext``
    run in each."""
    started = kernels(count)
    for kernel in started:
        kernel.run("%load_ext gpushare_ext").ok()
    return started
