"""The process of one rank started by :func:`gpushare_ext.runtime.ranks.run_ranks`.

What it is for: ``python -m gpushare_ext.runtime.rank_worker PAYLOAD_DIR RANK`` reads the
payload the launcher wrote (a cloudpickled callable with its arguments, or a cell's
source), joins ``torch.distributed`` through the rendezvous named in its environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GPUSHARE_RANK_BACKEND``),
runs the target and leaves ``result-<rank>.pkl`` or ``error-<rank>.json`` in the payload
directory for the launcher.  A SIGINT (the notebook's "Interrupt kernel", forwarded by the
launcher) raises KeyboardInterrupt here, so a training loop stops where it is.

What it must not do: outlive the notebook kernel that started it (it asks the kernel for
``PR_SET_PDEATHSIG`` first and exits at once if its parent is already gone); talk to the
broker or take a lease (the launcher's caller holds the leases, the placement arrives as
``CUDA_VISIBLE_DEVICES``); pick a device of its own; import torch or cloudpickle before it
knows it needs them; or write anywhere but its own two files in the payload directory.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import datetime
import json
import linecache
import os
import pickle
import signal
import sys
import time
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.safe_fs import open_private_file

PAYLOAD_NAME = "payload.pkl"
CELL_FILENAME = "<cell>"  # where a cell's source says it comes from, in tracebacks
INTERRUPTED_STATUS = 130  # what a shell reports for a process stopped by Ctrl-C
ORPHANED_STATUS = 3
DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for gloo collectives
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MESSAGE_CHARS = 500


class RankWorkerError(SessionError):
    """The worker itself could not do its part (set up, send its result); one line."""


def code_with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """Give a function shipped by value its file back (cloudpickle sends none), so that
    tracebacks name it and show its lines."""
    return code.replace(co_filename=filename)


def result_name(rank: int) -> str:
    return f"result-{rank}.pkl"


def error_name(rank: int) -> str:
    return f"error-{rank}.json"


def die_with_parent() -> None:
    """Have the kernel's death kill this process, and leave now if it already died.

    The check after ``prctl`` closes the window in which the parent died between our
    fork and the call: the signal is only armed for a parent that is still there.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    expected = os.environ.get("GPUSHARE_RANK_PARENT", "")
    parent = os.getppid()
    if parent == 1 or (expected.isdigit() and int(expected) != parent):
        os._exit(ORPHANED_STATUS)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:_MESSAGE_CHARS] if lines else ""


def user_traceback(exc: BaseException) -> str:
    """The traceback from the target's first frame on (this module's frames say nothing)."""
    frames = exc.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    return "".join(traceback.format_exception(type(exc), exc, frames or exc.__traceback__))


def _write_private(path: Path, data: bytes) -> None:
    fd = open_private_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def write_error(directory: Path, rank: int, exc: BaseException, trace: str) -> None:
    record = {
        "type": type(exc).__name__,
        "message": first_line(exc),
        "traceback": trace,
        "time": time.time(),  # the launcher blames the rank that failed first
    }
    _write_private(directory / error_name(rank), json.dumps(record).encode())


def write_result(directory: Path, rank: int, result: Any) -> None:
    try:
        import cloudpickle

        dumps = cloudpickle.dumps
    except ImportError:
        dumps = pickle.dumps
    try:
        data = dumps(result)
    except Exception as exc:
        raise RankWorkerError(
            f"gpushare: rank {rank} returned a {type(result).__name__}, which cannot be sent "
            f"back to the notebook: {first_line(exc)}"
        ) from None
    _write_private(directory / result_name(rank), data)


def load_payload(directory: Path) -> dict[str, Any]:
    """The payload, with the launcher's import path and cell sources in place."""
    fd = open_private_file(directory / PAYLOAD_NAME, os.O_RDONLY)
    with os.fdopen(fd, "rb") as file:
        payload: dict[str, Any] = pickle.load(file)
    # Functions the notebook imported from its own modules arrive by reference: they
    # must import here from where the notebook found them.
    sys.path.extend(entry for entry in payload["sys_path"] if entry not in sys.path)
    # Code typed into a cell has no file; its lines make the traceback readable.
    for filename, text in payload["lines"].items():
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    if payload["kind"] == "callable":
        try:
            payload["call"] = pickle.loads(payload["call"])
        except ModuleNotFoundError as exc:
            if exc.name == "cloudpickle":
                raise RankWorkerError(
                    "gpushare: the ranks need cloudpickle to receive a function: "
                    "pip install cloudpickle"
                ) from None
            raise
    return payload


def _limit_memory(torch: Any) -> None:
    """Keep PyTorch's caching allocator inside the lease's memory."""
    quota = os.environ.get("GPUSHARE_RANK_MEMORY_BYTES", "")
    if not quota.isdigit():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, int(quota) / total), 0)


def init_distributed(payload: dict[str, Any], world_size: int) -> bool:
    """Join the process group when it is wanted; True if this rank joined it."""
    if world_size <= 1 and not payload.get("distributed"):
        return False
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        if world_size > 1:
            raise RankWorkerError(
                "gpushare: the ranks need PyTorch for torch.distributed: pip install torch"
            ) from None
        return False
    backend = os.environ.get("GPUSHARE_RANK_BACKEND", "gloo")
    # The placement is the one visible device, so it is device 0 in here.
    if os.environ.get("CUDA_VISIBLE_DEVICES") and torch.cuda.is_available():
        _limit_memory(torch)
        if backend == "nccl":
            torch.cuda.set_device(0)
    timeout_s = float(os.environ.get("GPUSHARE_RANK_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=int(os.environ.get("RANK", "0")),
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return True


def destroy_distributed(ended_well: bool) -> None:
    """Leave the process group.  After a target that ended well every rank first waits
    for the others, so none tears its connections down while a peer still uses them
    (Gloo aborts the process then); after a failure the launcher stops every rank, so
    no rank waits for one that will never come."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if ended_well:
        with contextlib.suppress(Exception):
            dist.barrier()
    dist.destroy_process_group()


def ready_name(rank: int) -> str:
    return f"ready-{rank}"


GO_NAME = "go"
GO_POLL_S = 0.01
CONTROL_BLOCK_ENV = "GPUSHARE_RANK_CONTROL_BLOCK"
_followed: list[Any] = []  # the control block mapped for the shim: kept while the rank runs


def follow_gate() -> str:
    """With the launch shim preloaded (inherited from a kernel the server extension
    started), hold this rank's launches while the notebook's session is paused: the gate
    the shim follows is the session's control block.  Under MPS, where the checkpoint
    lock does not work, that gate is what pauses a gang.  Returns what was done, in a
    few words ("" when there is no shim or no block)."""
    path = os.environ.get(CONTROL_BLOCK_ENV, "")
    if not path:
        return ""
    from gpushare_ext.runtime import interpose

    if not interpose.preloaded_here():
        return ""
    from gpushare_ext.control_block import ControlBlock, ControlBlockError

    try:
        block = ControlBlock.open(path)
        attached = interpose.attach(block.address())
    except (ControlBlockError, interpose.InterposerError) as exc:
        return f"launches are not held on the host: {exc}"
    _followed.append(block)
    return attached.describe()


def start_cuda() -> None:
    """Make this rank's CUDA context now, before the broker is told which process runs
    the rank: the checkpoint lock that pauses a rank cannot stop a process that has
    none yet (CUDA_ERROR_NOT_INITIALIZED), and its work would then run unstopped."""
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        return
    try:
        from cuda.bindings import driver

        if driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS:
            error, device = driver.cuDeviceGet(0)
            if error == driver.CUresult.CUDA_SUCCESS:
                driver.cuDevicePrimaryCtxRetain(device)
    except Exception:  # no usable CUDA library: the target brings its own, if any
        return


def wait_for_go(directory: Path, rank: int) -> None:
    """Say this rank is ready, then wait until the launcher has named every rank's
    process to the broker (it then writes ``go``)."""
    _write_private(directory / ready_name(rank), b"")
    go = directory / GO_NAME
    while not go.exists():
        time.sleep(GO_POLL_S)


def release_exchanges() -> None:
    """After a target that ended well: every rank unmaps the others' gradient buffers
    before any rank frees its own (on a failure the launcher stops every rank instead,
    so no rank waits here for one that will never come)."""
    comm = sys.modules.get("gpushare_ext.runtime.rank_comm")
    if comm is not None:
        comm.release()


def run_target(payload: dict[str, Any]) -> Any:
    if payload["kind"] == "source":
        # A cell's functions and classes belong to __main__, as they do in the notebook,
        # so that pickle (DataLoader workers, torch.save) finds them there.
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = module
        exec(compile(payload["source"], CELL_FILENAME, "exec"), module.__dict__)
        return None
    target, args, kwargs = payload["call"]
    return target(*args, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank; the exit status is 0 only if its result was written."""
    die_with_parent()
    arguments = list(sys.argv[1:] if argv is None else argv)
    directory, rank = Path(arguments[0]), int(arguments[1])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    joined = ended_well = False
    try:
        payload = load_payload(directory)
        joined = init_distributed(payload, world_size)
        start_cuda()
        follow_gate()
        wait_for_go(directory, rank)
        result = run_target(payload)
        release_exchanges()
        write_result(directory, rank, result)
        ended_well = True
        return 0
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr, flush=True)
        write_error(directory, rank, exc, "")
        return INTERRUPTED_STATUS
    except SystemExit as exc:
        if exc.code in (None, 0):
            write_result(directory, rank, None)
            ended_well = True
            return 0
        write_error(directory, rank, exc, "")
        return exc.code if isinstance(exc.code, int) else 1
    except RankWorkerError as exc:
        print(exc, file=sys.stderr, flush=True)
        write_error(directory, rank, exc, "")
        return 1
    except BaseException as exc:
        trace = user_traceback(exc)
        sys.stderr.write(trace)
        sys.stderr.flush()
        write_error(directory, rank, exc, trace)
        return 1
    finally:
        if joined:
            destroy_distributed(ended_well)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Past this point only the interpreter's teardown is left, in which Gloo's threads
    # may still hold tensors and abort the process: the rank's work is done and said.
    os._exit(status)
