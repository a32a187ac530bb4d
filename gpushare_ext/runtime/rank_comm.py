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
* ``gloo`` (MIG instances, which cannot map each other's memory, or CPU ranks): DDP's
  gloo all-reduce, through the host.

The launcher names the path in ``GPUSHARE_RANK_COMM``
(:func:`~gpushare_ext.runtime.ranks.choose_comm`).  This module runs in rank processes
only: it must not be imported by a notebook kernel at start-up (it needs torch), and
every collective it starts, every rank starts too.
"""

from __future__ import annotations

import gc
import os
import struct
import time
from typing import Any

from gpushare_ext.runtime.errors import SessionError

COMM_ENV = "GPUSHARE_RANK_COMM"
PATHS = ("nccl", "cuda-ipc", "gloo")
# DDP rebuilds its buckets once, after the first step, in the order gradients became
# ready: each layout gets its own regions of the exchange buffer.
LAYOUTS = 2
BARRIER_TIMEOUT_S = 1800.0  # as long as a gloo collective may take
_COUNTER = struct.Struct("q")
_exchanges: list[SameDeviceExchange] = []  # for release() before the group goes


class ExchangeError(SessionError, RuntimeError):
    """The exchange between ranks cannot go on (buffers outgrown, a rank gone)."""


class HostBarrier:
    """A barrier of the gang's ranks in host shared memory: each rank publishes how many
    barriers it has reached, and waits until every rank has reached as many."""

    def __init__(self, rank: int, world: int) -> None:
        from multiprocessing import shared_memory

        import torch.distributed as dist

        self.rank, self.world = rank, world
        name = [""]
        if rank == 0:
            self._memory = shared_memory.SharedMemory(create=True, size=8 * world)
            self._memory.buf[: 8 * world] = bytes(8 * world)
            name = [self._memory.name]
        dist.broadcast_object_list(name, src=0)
        if rank != 0:
            self._memory = shared_memory.SharedMemory(name=name[0])
            # Rank 0 made it and unlinks it; Python's tracker would try again at exit.
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self._memory._name, "shared_memory")  # type: ignore[attr-defined]
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
        self._memory.close()
        if self.rank == 0:
            self._memory.unlink()


class SameDeviceExchange:
    """Exchange buffers of every rank on one GPU, mapped by each rank (CUDA IPC), with
    interprocess events that order the copies and the reads on the GPU itself."""

    def __init__(self, elements: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.capacity = LAYOUTS * elements
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
        self._regions: dict[tuple[int, int], int] = {}
        self._used = 0
        self._read_once = False
        _exchanges.append(self)

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
        flat.copy_(self.buffers[0][start : start + count])
        for other in self.buffers[1:]:
            flat.add_(other[start : start + count])
        flat.div_(self.world)
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


def distributed_model(model: Any, **ddp_options: Any) -> Any:
    """``model`` wrapped for data-parallel training across the gang's ranks (the model
    itself when this process is not part of a gang of several ranks)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return model
    parameters = [p for p in model.parameters() if p.requires_grad]
    on_gpu = bool(parameters) and parameters[0].is_cuda
    if on_gpu:
        ddp_options.setdefault("device_ids", [torch.cuda.current_device()])
    wrapped = nn.parallel.DistributedDataParallel(model, **ddp_options)
    if comm_path() == "cuda-ipc" and on_gpu:
        if any(p.dtype != torch.float32 for p in parameters):
            return wrapped  # the exchange buffers hold fp32 gradients; DDP's path does the rest
        exchange = SameDeviceExchange(sum(p.numel() for p in parameters))
        wrapped.register_comm_hook(exchange, _exchange_hook)
    return wrapped
