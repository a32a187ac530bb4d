"""How the ranks of a gang exchange gradients: the fastest path their slices allow.

:func:`distributed_model` wraps a module in ``DistributedDataParallel`` for the process
group the launcher set up, and picks how its gradients are averaged:

* ``nccl`` (every rank has a whole GPU of its own): DDP's own NCCL all-reduce;
* ``cuda-ipc`` (every rank is a software slice of one and the same GPU): through that
  GPU's memory (:class:`SameDeviceExchange`).  Each rank copies a bucket of gradients
  into an exchange buffer of its own that every rank of the gang has mapped (CUDA IPC)
  and sums all the buffers itself, in rank order, so that every rank gets the same
  bits.  The ranks order their GPU work with interprocess CUDA events and meet at
  barriers in host shared memory: no rank waits for the GPU on the host, so each keeps
  its stream full, and nothing goes through a socket;
* ``host-shm`` (every rank has a GPU, but they cannot map each other's memory: MIG
  instances, or GPUs of one host under the gloo backend): through one block of host
  shared memory that every rank has mapped and page-locked
  (:class:`HostSharedExchange`).  Each rank copies a bucket of gradients into its own
  slot of the block, waits for that copy on the host, meets the others at a barrier in
  host shared memory, copies every rank's slot of that bucket back to its GPU and sums
  them there, in rank order, so that every rank gets the same bits.  Nothing goes
  through a socket.  It also runs on CPU tensors (summed on the CPU), which is how it
  is tested without a GPU;
* ``gloo`` (CPU ranks, a gang of one, parameters that are not fp32, or a host-shm
  block that would not fit in ``/dev/shm``): DDP's gloo all-reduce, through the host.

The launcher names the path in ``GPUSHARE_RANK_COMM``
(:func:`~gpushare_ext.runtime.ranks.choose_comm`).  This module runs in rank processes
only: it must not be imported by a notebook kernel at start-up (it needs torch), and
every collective it starts, every rank starts too.
"""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import time
import warnings
from typing import Any

from gpushare_ext.runtime.errors import SessionError

COMM_ENV = "GPUSHARE_RANK_COMM"
PATHS = ("nccl", "cuda-ipc", "host-shm", "gloo")
# DDP rebuilds its buckets once, after the first step, in the order gradients became
# ready: each layout gets its own regions of the exchange buffer.
LAYOUTS = 2
# The host-shared block holds two copies of every slot, used by alternate buckets (see
# HostSharedExchange.average for why that makes one barrier a bucket enough).
PHASES = 2
BARRIER_TIMEOUT_S = 1800.0  # as long as a gloo collective may take
SHM_DIR = "/dev/shm"  # where Python's SharedMemory blocks live on Linux
_COUNTER = struct.Struct("q")
_FLOAT32_BYTES = 4
_exchanges: list[GradientExchange] = []  # for release() before the group goes


class ExchangeError(SessionError, RuntimeError):
    """The exchange between ranks cannot go on (buffers outgrown, a rank gone)."""


def _shm_free_bytes() -> int | None:
    """Free bytes where shared memory blocks live (None where that cannot be told)."""
    try:
        found = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return found.f_bavail * found.f_frsize


def _shared_block(rank: int, size: int) -> Any:
    """A block of ``size`` bytes of host shared memory that every rank of the gang maps
    (a ``SharedMemory``): rank 0 makes it, zeroed, and names it to the others.

    Every rank must call it at the same point (it is a collective), and every rank
    raises :class:`ExchangeError` when rank 0 finds too little room for it (a block
    larger than its file system would kill the rank with SIGBUS on first touch).  Only
    rank 0 may unlink the block (:func:`_close_block`): the others are taken off
    Python's resource tracker, which would otherwise unlink it again at their exit.
    """
    from multiprocessing import resource_tracker, shared_memory

    import torch.distributed as dist

    name = [""]
    free = _shm_free_bytes() if rank == 0 else None
    if rank == 0 and (free is None or free >= size):
        memory = shared_memory.SharedMemory(create=True, size=size)
        memory.buf[:size] = bytes(size)
        name = [memory.name]
    dist.broadcast_object_list(name, src=0)
    if not name[0]:
        raise ExchangeError(
            f"gpushare: the gradient exchange needs {-(-size >> 20)} MiB of {SHM_DIR} and "
            "it has less free"
        )
    if rank != 0:
        memory = shared_memory.SharedMemory(name=name[0])
        resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
    return memory


def _close_block(memory: Any, rank: int) -> None:
    """Unmap a block of :func:`_shared_block`; rank 0 also removes its name.  The other
    ranks' mappings stay valid until they close them, so no rank waits for another."""
    memory.close()
    if rank == 0:
        memory.unlink()


class HostBarrier:
    """A barrier of the gang's ranks in host shared memory: each rank publishes how many
    barriers it has reached, and waits until every rank has reached as many."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._memory = _shared_block(rank, 8 * world)
        self.count = 0

    def wait(self) -> None:
        self.count += 1
        buffer = self._memory.buf
        _COUNTER.pack_into(buffer, 8 * self.rank, self.count)
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        spins = 0
        while any(_COUNTER.unpack_from(buffer, 8 * k)[0] < self.count for k in range(self.world)):
            spins += 1
            if spins % 1000 == 0:
                if time.monotonic() > deadline:
                    raise ExchangeError("gpushare: a rank stopped answering the gradient exchange")
                time.sleep(0.0001)

    def close(self) -> None:
        _close_block(self._memory, self.rank)


def _mean_in_rank_order(flat: Any, parts: list[Any], world: int) -> None:
    """Write the mean of ``parts`` (one per rank, rank 0 first) into ``flat``.

    The sum is one fixed chain of additions in rank order, never a reduction whose order
    the library picks: every rank does exactly these operations on exactly these inputs,
    so every rank gets the same bits.
    """
    flat.copy_(parts[0])
    for part in parts[1:]:
        flat.add_(part)
    flat.div_(world)


class GradientExchange:
    """What the exchanges share: the gang's rank and size, and where each gradient
    bucket lives in an exchange buffer of ``LAYOUTS`` times the model's gradients.

    It must not allocate or map anything itself: the kinds of exchange differ in that.
    """

    def __init__(self, elements: int) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.capacity = LAYOUTS * elements
        self._regions: dict[tuple[int, int], int] = {}
        self._used = 0

    def region(self, bucket: int, elements: int) -> int:
        """Where bucket ``bucket`` of ``elements`` gradients lives in every buffer."""
        key = (bucket, elements)
        if key not in self._regions:
            if self._used + elements > self.capacity:
                raise ExchangeError(
                    f"gpushare: the gradient buckets need more than the {self.capacity} "
                    "elements set aside; wrap the model after it is built"
                )
            self._regions[key] = self._used
            self._used += elements
        return self._regions[key]

    def average(self, gradients: Any, bucket: int) -> Any:
        """Replace ``gradients`` (this rank's bucket) by the mean over all ranks."""
        raise NotImplementedError

    def release(self) -> None:
        """Let go of what the exchange maps or holds (once, when the rank is done)."""
        raise NotImplementedError


class SameDeviceExchange(GradientExchange):
    """Exchange buffers of every rank on one GPU, mapped by each rank (CUDA IPC), with
    interprocess events that order the copies and the reads on the GPU itself."""

    def __init__(self, elements: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        super().__init__(elements)
        self.mine = torch.zeros(self.capacity, dtype=torch.float32, device="cuda")
        # "my bucket is copied" and "I have read every bucket": one of each per rank.
        self.copied = torch.cuda.Event(blocking=False, interprocess=True)
        self.read = torch.cuda.Event(blocking=False, interprocess=True)
        shared = (reduce_tensor(self.mine), self.copied.ipc_handle(), self.read.ipc_handle())
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, shared)
        device = torch.cuda.current_device()
        self.buffers, self.peers_copied, self.peers_read = [], [], []
        for rank, ((rebuild, arguments), copied, read) in enumerate(everyone):
            if rank == self.rank:
                self.buffers.append(self.mine)
                continue
            self.buffers.append(rebuild(*arguments))
            self.peers_copied.append(torch.cuda.Event.from_ipc_handle(device, copied))
            self.peers_read.append(torch.cuda.Event.from_ipc_handle(device, read))
        self.barrier = HostBarrier(self.rank, self.world)
        self._read_once = False
        _exchanges.append(self)

    def average(self, gradients: Any, bucket: int) -> Any:
        """Replace ``gradients`` (this rank's bucket) by the mean over all ranks."""
        import torch

        stream = torch.cuda.current_stream()
        count = gradients.numel()
        start = self.region(bucket, count)
        flat = gradients.view(-1)
        if self._read_once:
            for event in self.peers_read:  # nobody still reads what this copy overwrites
                stream.wait_event(event)
        self.mine[start : start + count].copy_(flat)
        self.copied.record(stream)
        self.barrier.wait()  # every rank's copy is recorded: its event is this bucket's
        for event in self.peers_copied:
            stream.wait_event(event)
        _mean_in_rank_order(flat, [b[start : start + count] for b in self.buffers], self.world)
        self.read.record(stream)
        self._read_once = True
        self.barrier.wait()  # every rank's reads are recorded before anyone copies again
        return gradients

    def release(self) -> None:
        """Unmap the other ranks' buffers once every rank is done with them."""
        import torch

        torch.cuda.current_stream().synchronize()
        self.barrier.wait()
        self.buffers = [self.mine]
        self.peers_copied, self.peers_read = [], []
        gc.collect()  # the mapped buffers go now, not when the interpreter ends
        torch.cuda.ipc_collect()
        self.barrier.wait()
        self.barrier.close()


def _forget_cuda_error() -> None:
    """Clear the CUDA runtime's last error, which a refused call leaves behind: torch
    checks it after its next kernel launch and would raise there, far from the cause."""
    import ctypes

    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:  # the runtime torch loaded: dlopen hands back the same one
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(path).cudaGetLastError()


def _page_lock(tensor: Any) -> bool:
    """Page-lock the host memory under ``tensor`` for this rank's CUDA context, so that
    copies between it and the GPU are DMA.  False where the driver refuses: the copies
    then go through pageable memory, slower but with the same result, so nothing is said."""
    import torch

    try:
        result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    except (AttributeError, RuntimeError):  # a torch without the binding
        return False
    if int(result) == 0:
        return True
    _forget_cuda_error()
    return False


class HostSharedExchange(GradientExchange):
    """Slots of every rank in one block of host shared memory, page-locked by each rank
    where the driver lets it: for ranks that have GPUs but cannot map each other's
    memory (MIG instances), and for CPU ranks.

    Layout: ``PHASES`` halves, each ``world * capacity`` float32.  A bucket's region of
    ``count`` elements at ``start`` occupies ``world * count`` elements at ``start *
    world`` of its half, rank 0's slot first, so that one copy brings every rank's slot
    of a bucket to the GPU.  It must not be used for anything but fp32 gradients.
    """

    def __init__(self, elements: int, device: Any) -> None:
        import torch

        super().__init__(elements)
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        size = PHASES * self.world * self.capacity
        self.barrier = HostBarrier(self.rank, self.world)
        try:
            self._memory = _shared_block(self.rank, size * _FLOAT32_BYTES)
        except ExchangeError:
            self.barrier.close()
            raise
        self._halves = torch.frombuffer(self._memory.buf, dtype=torch.float32, count=size)
        self._halves = self._halves.view(PHASES, self.world * self.capacity)
        self.pinned = self.on_gpu and _page_lock(self._halves)
        # "my bucket has landed in my slot" and "my reads of the last bucket are done".
        self._copied = torch.cuda.Event() if self.on_gpu else None
        self._read = torch.cuda.Event() if self.on_gpu else None
        self._calls = 0
        # Every rank has mapped both blocks before any may go on (and rank 0 unlink them).
        self.barrier.wait()
        _exchanges.append(self)

    def average(self, gradients: Any, bucket: int) -> Any:
        """Replace ``gradients`` (this rank's bucket) by the mean over all ranks.

        One barrier a bucket is enough because consecutive buckets use different halves
        of the block.  A rank reaches the barrier of bucket k only once its own copy of
        bucket k has landed in its slot and its reads of bucket k-1 are done (on the
        CPU both are done on return; on the GPU the host waits for them): so when the
        barrier of bucket k opens, every rank has finished writing bucket k and reading
        bucket k-1.  Bucket k+1 then overwrites the half of bucket k-1, which nobody
        reads any more, while bucket k's half stays untouched until every rank has
        passed the barrier of bucket k+1, that is, has read bucket k.
        """
        count = gradients.numel()
        start = self.region(bucket, count)
        flat = gradients.view(-1)
        half = self._halves[self._calls % PHASES]
        self._calls += 1
        slots = half[start * self.world : (start + count) * self.world].view(self.world, count)
        slots[self.rank].copy_(flat, non_blocking=self.pinned)
        if self._copied is not None and self._read is not None:
            # On the host, since the others read the slot from there: this copy, and
            # everything queued before it on this stream, the last bucket's reads among
            # them (those are waited for as well, should they have been on another stream).
            self._copied.record()
            self._copied.synchronize()
            self._read.synchronize()
        self.barrier.wait()
        if self._read is not None:
            import torch

            staging = torch.empty((self.world, count), dtype=flat.dtype, device=flat.device)
            staging.copy_(slots, non_blocking=self.pinned)
            self._read.record()
            slots = staging
        _mean_in_rank_order(flat, list(slots), self.world)
        return gradients

    def release(self) -> None:
        """Unlock and unmap the block once this rank's copies are done.  No rank waits
        for the others: each reads only its own mapping, which stays valid until it
        closes it, whenever rank 0 removes the block's name."""
        import torch

        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._halves.data_ptr())
            self.pinned = False
        del self._halves  # the block cannot be unmapped while a tensor views it
        gc.collect()
        _close_block(self._memory, self.rank)
        self.barrier.close()


def release() -> None:
    """Let go of every exchange of this rank (the worker calls it before it leaves the
    process group, so no buffer outlives the rank that made it)."""
    while _exchanges:
        _exchanges.pop().release()


# No annotations: DDP checks a hook's annotations against its own types, and this
# module's (strings, under postponed evaluation) would not match them.
def _exchange_hook(exchange, bucket):
    import torch

    future: Any = torch.futures.Future()
    future.set_result(exchange.average(bucket.buffer(), bucket.index()))
    return future


def comm_path() -> str:
    """The gradient path the launcher chose for this rank's gang."""
    path = os.environ.get(COMM_ENV, "gloo")
    return path if path in PATHS else "gloo"


def _exchange_for(path: str, parameters: list[Any]) -> GradientExchange | None:
    """The exchange of ``path`` for these parameters, or None where DDP's own all-reduce
    is the path (nccl, gloo, cuda-ipc on the CPU) or the only one that fits (a buffer
    that is not fp32: the exchanges hold fp32 gradients)."""
    import torch

    on_gpu = parameters[0].is_cuda
    wanted = path == "host-shm" or (path == "cuda-ipc" and on_gpu)
    if not wanted or any(p.dtype != torch.float32 for p in parameters):
        return None
    elements = sum(p.numel() for p in parameters)
    if path == "cuda-ipc":
        return SameDeviceExchange(elements)
    try:
        return HostSharedExchange(elements, parameters[0].device)
    except ExchangeError as exc:  # every rank got the same answer from rank 0
        # gloo still averages the gradients, only slower: worth a line, not a failure.
        warnings.warn(f"{exc}; gradients go through gloo instead", stacklevel=3)
        return None


def distributed_model(model: Any, **ddp_options: Any) -> Any:
    """``model`` wrapped for data-parallel training across the gang's ranks (the model
    itself when this process is not part of a gang of several ranks)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return model
    parameters = [p for p in model.parameters() if p.requires_grad]
    if parameters and parameters[0].is_cuda:
        ddp_options.setdefault("device_ids", [torch.cuda.current_device()])
    wrapped = nn.parallel.DistributedDataParallel(model, **ddp_options)
    exchange = _exchange_for(comm_path(), parameters) if parameters else None
    if exchange is not None:
        wrapped.register_comm_hook(exchange, _exchange_hook)
    return wrapped
