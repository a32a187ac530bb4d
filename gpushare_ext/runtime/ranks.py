"""Run a function or a cell as the ranks of a ``torch.distributed`` job, from a notebook.

What it is for: :func:`run_ranks` starts one worker process per placement (a GPU, a MIG
instance, an MPS share of a GPU, or ``None`` for a CPU rank), each bound to its slice
through ``CUDA_VISIBLE_DEVICES`` and meeting the others at a rendezvous on this host, and
returns what each rank returned.  The workers' output streams into the running cell line
by line, prefixed with the rank; a failing rank stops the others and raises
:class:`RankFailed` with its traceback; interrupting the kernel interrupts every rank.
:func:`choose_backend` says which backend the slices allow (NCCL needs a whole device of
its own per rank, gloo works everywhere).

What it must not do: take leases or talk to the broker (the caller brings the placements
of leases it holds), import torch or cloudpickle at import time (the package works
without them), or leave a worker process running or its payload on disk, whichever way
the call ends.  The worker's side is :mod:`gpushare_ext.runtime.rank_worker`.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import json
import linecache
import os
import pickle
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpushare_ext.protocol import Placement
from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.runtime.rank_worker import (
    CELL_FILENAME,
    CONTROL_BLOCK_ENV,
    GO_NAME,
    PAYLOAD_NAME,
    RankWorkerError,
    code_with_filename,
    error_name,
    ready_name,
    result_name,
)
from gpushare_ext.safe_fs import fresh_private_directory, open_private_file, remove_own_directory

__all__ = [
    "BACKENDS",
    "MissingDependency",
    "RankError",
    "RankFailed",
    "RankUsageError",
    "RendezvousError",
    "UnknownBackend",
    "choose_backend",
    "choose_comm",
    "mps_limits",
    "rank_environment",
    "run_ranks",
]

BACKENDS = ("gloo", "nccl")
MASTER_ADDR = "127.0.0.1"
WORKER_MODULE = "gpushare_ext.runtime.rank_worker"
POLL_S = 0.05
READER_JOIN_S = 2.0  # a worker's child that keeps its pipe open must not hang the cell
# Limits the kernel's own lease may have put in its environment (binding.apply_mps_limits);
# a rank gets those of its own placement or none.
_INHERITED_LIMITS = (
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "GPUSHARE_RANK_MEMORY_BYTES",
    "GPUSHARE_RANK_CONTROL_BLOCK",
)
_PLACEHOLDER_FILENAME = "<dynamic-code>"  # what cloudpickle writes instead of a file name
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class RankError(SessionError):
    """Something about running ranks went wrong; said in one line."""

    code = "ranks"


class RankUsageError(RankError, ValueError):
    """run_ranks was called with something it cannot run; nothing was started."""

    code = "ranks_usage"


class UnknownBackend(RankUsageError):
    """``backend=`` names no backend this launcher knows."""

    code = "unknown_backend"


class MissingDependency(RankError, ImportError):
    """A package the ranks need (cloudpickle, torch) is not installed; names the pip package."""

    code = "missing_dependency"


class RendezvousError(RankError):
    """The ranks cannot meet: the rendezvous port cannot be bound on this host."""

    code = "rendezvous"


class RankFailed(RankError):
    """One rank raised or died; the others were stopped.

    ``str()`` is one line (``rank 2 of 4 failed: ValueError: boom``); the rank's own
    traceback is in ``remote_traceback`` (and in the exception's notes, which IPython shows).
    """

    code = "rank_failed"

    def __init__(self, rank: int, world_size: int, what: str, remote_traceback: str = "") -> None:
        super().__init__(f"rank {rank} of {world_size} {what}")
        self.rank = rank
        self.world_size = world_size
        self.what = what
        self.remote_traceback = remote_traceback
        if remote_traceback and hasattr(self, "add_note"):  # Python 3.11+
            self.add_note(f"--- traceback of rank {rank} ---\n{remote_traceback.rstrip()}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.world_size, self.what, self.remote_traceback))


# ------------------------------------------------------------------ backend and rendezvous


def choose_backend(placements: Sequence[Placement | None]) -> tuple[str, str]:
    """(backend, one-line reason) for these placements.

    NCCL refuses two ranks on one device and cannot reach across MIG instances (they
    cannot use CUDA IPC with each other); gloo also all-reduces CUDA tensors, through
    the host, so it is what every other layout gets.
    """
    if not placements:
        raise RankUsageError("gpushare: no ranks to run: pass one placement per rank")
    cpu_ranks = [rank for rank, placement in enumerate(placements) if placement is None]
    if len(cpu_ranks) == len(placements):
        return "gloo", "every rank runs on the CPU"
    if cpu_ranks:
        return "gloo", f"rank {cpu_ranks[0]} runs on the CPU"
    gpus = [placement for placement in placements if placement is not None]  # rank order
    for rank, placement in enumerate(gpus):
        if placement.mig_uuid:
            instance = placement.mig_profile or placement.mig_uuid
            return "gloo", f"rank {rank} is on MIG instance {instance}, which NCCL cannot use"
    first_rank_on: dict[str, int] = {}
    for rank, placement in enumerate(gpus):
        other = first_rank_on.setdefault(placement.device_uuid, rank)
        if other != rank:
            return "gloo", f"ranks {other} and {rank} share GPU {placement.device_index}"
    return "nccl", "every rank has a GPU of its own"


def choose_comm(placements: Sequence[Placement | None], backend: str) -> str:
    """How the gang's gradients are averaged (:mod:`~gpushare_ext.runtime.rank_comm`):
    ``nccl`` with the NCCL backend; ``gloo`` for a gang of one or one with a CPU rank;
    ``cuda-ipc`` when every rank is a software slice of one and the same GPU (they can
    map each other's memory); ``host-shm`` when every rank has a GPU but they cannot
    (MIG instances, or GPUs of this host under the gloo backend): through pinned host
    shared memory, which every rank of a gang on one host can map."""
    if backend == "nccl":
        return "nccl"
    if len(placements) < 2 or any(p is None for p in placements):
        return "gloo"
    devices = {p.device_uuid for p in placements if p is not None}
    on_mig = any(p is not None and p.mig_uuid for p in placements)
    if not on_mig and len(devices) == 1:
        return "cuda-ipc"
    return "host-shm"


def resolve_backend(placements: Sequence[Placement | None], backend: str | None) -> tuple[str, str]:
    if backend is None:
        return choose_backend(placements)
    name = backend.strip().lower() if isinstance(backend, str) else backend
    if name not in BACKENDS:
        raise UnknownBackend(
            f"gpushare: unknown backend {backend!r}: use 'gloo' or 'nccl', or leave it unset"
        )
    if name == "nccl":
        cpu_ranks = [rank for rank, placement in enumerate(placements) if placement is None]
        if cpu_ranks:
            raise RankUsageError(
                f"gpushare: backend='nccl' needs a GPU for every rank and rank {cpu_ranks[0]} "
                "has none; leave backend unset to use gloo"
            )
    return name, "asked for with backend="


def _bind_probe(port: int) -> int:
    # SO_REUSEADDR as the rendezvous store sets it: a port left in TIME_WAIT by an earlier
    # run is free to it, a port another socket holds is not.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", port))  # the store listens on every address
        return int(probe.getsockname()[1])


def rendezvous_port(port: int | None) -> int:
    """``port`` once it is known to be free on this host, or a free one."""
    if port is None:
        return _bind_probe(0)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise RankUsageError(f"gpushare: port must be an int in 1..65535, not {port!r}")
    try:
        return _bind_probe(port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"gpushare: rendezvous port {port} is in use on this host; "
                "leave port unset to use a free one"
            ) from None
        raise RendezvousError(
            f"gpushare: rendezvous port {port} cannot be bound on this host "
            f"({exc.strerror}); leave port unset to use a free one"
        ) from None


# ------------------------------------------------------------------ environment


def mps_limits(placement: Placement) -> dict[str, str]:
    """The MPS client limits of a rank, computed as ``binding.apply_mps_limits`` does.

    The one difference: a rank sees only its own GPU (CUDA_VISIBLE_DEVICES names it), so
    the memory limit is for device 0 rather than for the GPU's index on the host.
    """
    return {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, round(placement.sm_share * 100))),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={placement.memory_bytes >> 20}M",
    }


def _threads_per_rank(world_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _python_path(inherited: str | None) -> str | None:
    """PYTHONPATH that lets ``python -m`` find this package when it runs from a source tree."""
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if _PACKAGE_ROOT in site_dirs:
        return inherited
    entries = [entry for entry in (inherited or "").split(os.pathsep) if entry]
    if _PACKAGE_ROOT in entries:
        return inherited
    return os.pathsep.join([_PACKAGE_ROOT, *entries])


def rank_environment(
    rank: int,
    world_size: int,
    placement: Placement | None,
    backend: str,
    port: int,
    base: dict[str, str] | None = None,
    comm: str = "gloo",
    control_block: str | None = None,
) -> dict[str, str]:
    """The environment of one worker: ``base`` (os.environ) with the rank's own settings."""
    inherited = dict(os.environ if base is None else base)
    env = {key: value for key, value in inherited.items() if key not in _INHERITED_LIMITS}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
        GPUSHARE_RANK_BACKEND=backend,
        GPUSHARE_RANK_COMM=comm,
        GPUSHARE_RANK_PARENT=str(os.getpid()),
    )
    # Every rank is on this host: gloo over loopback never depends on how the host
    # name resolves.  Ranks on the CPU would otherwise each start a thread per core.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(world_size)))
    python_path = _python_path(inherited.get("PYTHONPATH"))
    if python_path:
        env["PYTHONPATH"] = python_path
    if placement is None:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU rank never touches a GPU
        return env
    env["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices
    env["GPUSHARE_RANK_MEMORY_BYTES"] = str(placement.memory_bytes)
    if control_block:
        env[CONTROL_BLOCK_ENV] = control_block
    if placement.mps:
        env.update(mps_limits(placement))
    return env


# ------------------------------------------------------------------ payload


def _require_cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError:
        raise MissingDependency(
            "gpushare: run_ranks needs cloudpickle to send a function to its ranks: "
            "pip install cloudpickle"
        ) from None
    return cloudpickle


def _what_cannot_be_pickled(
    dumps: Callable[[Any], bytes], target: Any, args: tuple, kwargs: dict
) -> str:
    name = getattr(target, "__qualname__", type(target).__name__)
    pieces: list[tuple[str, Any]] = [(f"the target {name}", target)]
    pieces += [(f"argument {index}", value) for index, value in enumerate(args, start=1)]
    pieces += [(f"keyword argument {key}", value) for key, value in kwargs.items()]
    for label, value in pieces:
        try:
            dumps(value)
        except Exception as exc:
            return f"{label} (a {type(value).__name__}) cannot be sent to the ranks: {exc}"
    return "the call cannot be sent to the ranks"


def _dumps_keeping_filenames(cloudpickle: Any, value: Any) -> tuple[bytes, set[str]]:
    """cloudpickle's bytes for ``value`` with the files of the code it ships by value.

    cloudpickle replaces a shipped function's file name by a placeholder; a rank's
    traceback would then show neither where it failed nor the line.  The names travel
    beside the code instead, and are put back when the rank unpickles it.
    """
    filenames: set[str] = set()

    class KeepingFilenames(cloudpickle.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, types.CodeType) and obj.co_filename != _PLACEHOLDER_FILENAME:
                filenames.add(obj.co_filename)
                stripped = obj.replace(co_filename=_PLACEHOLDER_FILENAME)
                return code_with_filename, (stripped, obj.co_filename)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    KeepingFilenames(buffer).dump(value)
    return buffer.getvalue(), filenames


def _cell_lines(filenames: set[str]) -> dict[str, str]:
    """The source of code typed into cells: it exists only in this process's linecache."""
    lines = {}
    for filename in filenames:
        entry = linecache.cache.get(filename)
        if entry and len(entry) >= 3 and not os.path.exists(filename):
            lines[filename] = "".join(entry[2])
    return lines


def build_payload(target: Any, args: tuple, kwargs: dict, world_size: int) -> dict[str, Any]:
    """What every worker reads: the call (or source), the import path, cell sources."""
    payload: dict[str, Any] = {"sys_path": list(sys.path), "lines": {}}
    if isinstance(target, str):
        if args or kwargs:
            raise RankUsageError("gpushare: a cell's source takes no arguments; pass a function")
        try:
            compile(target, CELL_FILENAME, "exec")
        except SyntaxError as exc:
            raise RankUsageError(
                f"gpushare: the cell does not compile: {exc.msg} (line {exc.lineno})"
            ) from None
        payload.update(kind="source", source=target, distributed="torch" in target)
        payload["lines"] = {CELL_FILENAME: target}
    elif callable(target):
        cloudpickle = _require_cloudpickle()
        try:
            call, filenames = _dumps_keeping_filenames(cloudpickle, (target, args, kwargs))
        except Exception:
            detail = _what_cannot_be_pickled(cloudpickle.dumps, target, args, kwargs)
            raise RankUsageError(f"gpushare: {detail}") from None
        # A call that mentions torch wants its process group even with one rank.
        payload.update(kind="callable", call=call, distributed=b"torch" in call)
        payload["lines"] = _cell_lines(filenames)
    else:
        raise RankUsageError(
            "gpushare: run_ranks runs a function or a cell's source (a str), "
            f"not a value of type {type(target).__name__}"
        )
    if world_size > 1 and importlib.util.find_spec("torch") is None:
        raise MissingDependency(
            f"gpushare: {world_size} ranks need PyTorch for torch.distributed: pip install torch"
        )
    return payload


# ------------------------------------------------------------------ the launch


class _LineWriter:
    """Serialises whole lines from the reader threads into one stream."""

    def __init__(self, stream: Any, lock: threading.Lock) -> None:
        self._stream = stream
        self._lock = lock

    def write(self, text: str) -> None:
        with self._lock:
            try:
                self._stream.write(text)
                flush = getattr(self._stream, "flush", None)
                if flush is not None:
                    flush()
            except Exception:  # a closed stream must not stop the pipe being drained
                pass


def _copy_lines(pipe: IO[bytes], prefix: str, sink: _LineWriter) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", "replace")
            sink.write(prefix + (text if text.endswith("\n") else text + "\n"))


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)

    def signal_group(self, sig: int) -> None:
        # The worker leads its own session, so its process group is its pid and holds
        # whatever it started (DataLoader workers) too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


def _describe_exit(status: int, record: dict[str, Any] | None) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = str(-status)
        return f"died (signal {name})"
    if record is None:
        return f"exited with status {status}"
    if record.get("type") == RankWorkerError.__name__:
        return f"failed: {record.get('message', '')}"
    message = record.get("message", "")
    return f"failed: {record.get('type')}: {message}" if message else f"failed: {record['type']}"


@dataclass
class _Launch:
    payload: dict[str, Any]
    placements: list[Placement | None]
    backend: str
    port: int
    out: _LineWriter
    err: _LineWriter
    grace_s: float
    directory: Path | None = None
    workers: list[_Worker] = field(default_factory=list)
    on_started: Callable[[list[int]], None] | None = None
    comm: str = "gloo"
    control_block: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.placements)

    def run(self, start_line: str) -> list[Any]:
        try:
            self.directory = fresh_private_directory(tempfile.gettempdir(), "gpushare-ranks-")
            self._write_payload()
            self.out.write(start_line + "\n")
            try:
                self._start_all()
                failed = self._wait_until_ready()
                if not failed:
                    if self.on_started is not None:
                        self.on_started([worker.process.pid for worker in self.workers])
                    self._let_go()
                    failed = self._wait_for_exits()
            except KeyboardInterrupt:
                self._stop((signal.SIGINT, signal.SIGTERM))
                self.out.write(f"gpushare: stopped all {self.world_size} ranks\n")
                raise
            if failed:
                self._stop((signal.SIGTERM,))
                raise self._failure(failed)
            self._join_readers()
            return [self._result(worker.rank) for worker in self.workers]
        finally:
            self._clean_up()

    def _clean_up(self) -> None:
        """Kill and reap every rank, remove the payload: even through a second Ctrl-C,
        which is raised once the ranks are gone."""
        interrupted = False
        while True:
            try:
                self._stop(())
                if self.directory is not None and not remove_own_directory(self.directory):
                    shutil.rmtree(self.directory, ignore_errors=True)
                break
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt

    def _write_payload(self) -> None:
        assert self.directory is not None
        fd = open_private_file(self.directory / PAYLOAD_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as file:
            pickle.dump(self.payload, file)

    def _start_all(self) -> None:
        for rank, placement in enumerate(self.placements):
            env = rank_environment(
                rank, self.world_size, placement, self.backend, self.port, comm=self.comm,
                control_block=self.control_block,
            )  # fmt: skip
            process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(self.directory), str(rank)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C in the kernel reaches the ranks through us
            )
            worker = _Worker(rank, process)
            self.workers.append(worker)
            for pipe, sink, name in (
                (process.stdout, self.out, "out"),
                (process.stderr, self.err, "err"),
            ):
                reader = threading.Thread(
                    target=_copy_lines,
                    args=(pipe, f"[rank {rank}] ", sink),
                    name=f"gpushare-rank-{rank}-{name}",
                    daemon=True,
                )
                reader.start()
                worker.readers.append(reader)

    def _wait_until_ready(self) -> list[_Worker]:
        """Wait until every rank has joined the group and made its CUDA context (it then
        waits for ``go``); return the ranks that failed first, if any did."""
        assert self.directory is not None
        while True:
            failed = [w for w in self.workers if w.process.poll() not in (None, 0)]
            if failed:
                return failed
            if all((self.directory / ready_name(w.rank)).exists() for w in self.workers):
                return []
            time.sleep(POLL_S / 5)

    def _let_go(self) -> None:
        assert self.directory is not None
        os.close(open_private_file(self.directory / GO_NAME, os.O_WRONLY | os.O_CREAT))

    def _wait_for_exits(self) -> list[_Worker]:
        """Wait until every rank exited 0 (returns []) or some failed (returns those)."""
        while True:
            statuses = [worker.process.poll() for worker in self.workers]
            failed = [
                w
                for w, status in zip(self.workers, statuses, strict=True)
                if status not in (None, 0)
            ]
            if failed or all(status == 0 for status in statuses):
                return failed
            time.sleep(POLL_S)

    def _wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(worker.process.poll() is None for worker in self.workers):
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _stop(self, signals: Sequence[int]) -> None:
        """Send each signal in turn to the ranks still running, ``grace_s`` apart, then
        SIGKILL what is left (and what the ranks started) and reap them all."""
        for sig in signals:
            running = [worker for worker in self.workers if worker.process.poll() is None]
            if not running:
                break
            for worker in running:
                worker.signal_group(sig)
            if self._wait_all(self.grace_s):
                break
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(self.grace_s, 1.0))
        self._join_readers()

    def _join_readers(self) -> None:
        for worker in self.workers:
            for reader in worker.readers:
                reader.join(timeout=READER_JOIN_S)

    def _error_record(self, rank: int) -> dict[str, Any] | None:
        assert self.directory is not None
        try:
            fd = open_private_file(self.directory / error_name(rank), os.O_RDONLY)
        except Exception:
            return None
        with os.fdopen(fd, "rb") as file:
            try:
                record = json.loads(file.read())
            except ValueError:
                return None
        return record if isinstance(record, dict) else None

    def _failure(self, failed: list[_Worker]) -> RankFailed:
        """The failure to blame: a rank killed by a signal first (the others then lose
        their peer), else the earliest error."""
        records = {worker.rank: self._error_record(worker.rank) for worker in failed}

        def blame_order(worker: _Worker) -> tuple[int, float, int]:
            record = records[worker.rank]
            died = worker.process.returncode < 0
            when = float(record.get("time", 0.0)) if record else 0.0
            return (0 if died else 1, when, worker.rank)

        culprit = min(failed, key=blame_order)
        record = records[culprit.rank]
        return RankFailed(
            culprit.rank,
            self.world_size,
            _describe_exit(culprit.process.returncode, record),
            str(record.get("traceback", "")) if record else "",
        )

    def _result(self, rank: int) -> Any:
        assert self.directory is not None
        try:
            fd = open_private_file(self.directory / result_name(rank), os.O_RDONLY)
        except Exception:
            raise RankError(f"gpushare: rank {rank} exited without leaving its result") from None
        with os.fdopen(fd, "rb") as file:
            try:
                return pickle.load(file)
            except Exception as exc:
                raise RankError(
                    f"gpushare: the result of rank {rank} cannot be read in the notebook: {exc}"
                ) from None


def _check_placements(placements: Any) -> list[Placement | None]:
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        raise RankUsageError(
            "gpushare: placements must be a list, one placement (or None) per rank"
        )
    for rank, placement in enumerate(placements):
        if placement is not None and not isinstance(placement, Placement):
            raise RankUsageError(
                f"gpushare: placement of rank {rank} is a {type(placement).__name__}, "
                "not a Placement or None"
            )
    if not placements:
        raise RankUsageError("gpushare: no ranks to run: pass one placement per rank")
    return list(placements)


def run_ranks(
    target: Callable[..., Any] | str,
    *args: Any,
    placements: list[Placement | None],
    port: int | None = None,
    backend: str | None = None,
    out: Any = None,
    err: Any = None,
    grace_s: float = 5.0,
    on_started: Callable[[list[int]], None] | None = None,
    control_block: str | None = None,
    payload: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``target(*args, **kwargs)`` (or a cell's source) in one process per placement.

    Returns each rank's return value in rank order (None for a cell's source).  Raises
    :class:`RankFailed` when a rank raises or dies (the others are stopped first),
    :class:`RankUsageError` / :class:`RendezvousError` / :class:`MissingDependency` before
    any process starts, and KeyboardInterrupt after stopping every rank when the kernel is
    interrupted.  The ranks' output goes to ``out`` / ``err`` (by default this cell's
    stdout and stderr), one ``[rank N] `` line at a time, while they run.
    ``on_started`` is called with the workers' pids, in rank order, once all have
    started (the caller names them to the broker); if it raises, every rank is stopped.
    GPU ranks that have the launch shim follow the gate of ``control_block`` (the
    session's), so a pause holds their launches.  ``payload`` is what
    :func:`build_payload` made of the same target and arguments, when the caller
    already checked them that way (it is not pickled twice).
    """
    lock = threading.Lock()
    stdout = _LineWriter(sys.stdout if out is None else out, lock)
    stderr = _LineWriter(sys.stderr if err is None else err, lock)
    checked = _check_placements(placements)
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s < 0:
        raise RankUsageError(f"gpushare: grace_s must be a number of seconds >= 0, not {grace_s!r}")
    chosen, reason = resolve_backend(checked, backend)
    if payload is None:
        payload = build_payload(target, args, kwargs, len(checked))
    master_port = rendezvous_port(port)
    count = f"{len(checked)} rank{'s' if len(checked) != 1 else ''}"
    comm = choose_comm(checked, chosen)
    through = {
        "cuda-ipc": "; distributed_model averages gradients in the GPU's memory",
        "host-shm": "; distributed_model averages gradients in pinned host shared memory",
    }
    start_line = (
        f"gpushare: starting {count} ({chosen}: {reason}; rendezvous {MASTER_ADDR}:{master_port}"
        f"{through.get(comm, '')})"
    )
    launch = _Launch(payload, checked, chosen, master_port, stdout, stderr, float(grace_s))
    launch.on_started = on_started
    launch.comm = comm
    launch.control_block = control_block
    return launch.run(start_line)
