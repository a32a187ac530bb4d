"""Device binding: make this kernel process use the GPU or MIG instance its lease names.

A MIG instance is reached through ``CUDA_VISIBLE_DEVICES=MIG-…``, which CUDA reads once
at initialisation, so it must be set before the process's first CUDA call.  A whole GPU
is selected in every framework the process uses instead (``frameworks/``), with every
GPU visible and numbered in PCI order (as NVML numbers them), so a later cell may run on
another GPU.  If the lease
cannot be honoured (a MIG instance after CUDA started, GPUs hidden by the environment)
the binding says why and how to fix it.

Whether CUDA was initialised is read from ``/proc/self/maps``: if ``libcuda`` is not
mapped, nothing in this process has called the driver yet.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from gpushare_ext.protocol import Placement
from gpushare_ext.runtime import frameworks
from gpushare_ext.runtime.errors import SessionError

current_ordinal: int | None = None  # the CUDA device of the lease in force


class BindingError(SessionError):
    """The lease's device cannot be used by this process; the message says how to fix it."""


@dataclass(frozen=True)
class Binding:
    visible: str  # what CUDA_VISIBLE_DEVICES names (a UUID), or "" when all are visible
    ordinal: int  # CUDA device ordinal to use inside this process
    how: str  # one sentence for the user


# Where the NVIDIA container toolkit's "volume-mounts" strategy lists a container's GPUs
# (one empty file per UUID) when NVIDIA_VISIBLE_DEVICES points there.
CONTAINER_DEVICES_DIR = "/var/run/nvidia-container-devices"
MAX_VISIBLE = 64  # what the broker's hello accepts


def visible_gpus(environ: dict[str, str] | None = None) -> list[str] | None:
    """The host's GPUs this process can reach, for the broker to place its leases on:
    None where every GPU of the host is reachable (``NVIDIA_VISIBLE_DEVICES`` unset or
    ``all``), else the GPU or MIG UUIDs (or host indices) that the NVIDIA device plugin
    gave the container, ``[]`` for none (``void``, ``none``).

    The container runtime reads ``NVIDIA_VISIBLE_DEVICES``; inside the container CUDA
    and NVML number the GPUs it exposed from 0, so only UUIDs and host indices mean the
    same to the broker on the host."""
    environ = os.environ if environ is None else environ
    value = environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if value in ("", "all"):
        return None
    if value in ("void", "none"):
        return []
    if value.startswith(CONTAINER_DEVICES_DIR):
        try:
            names = sorted(os.listdir(value))
        except OSError:
            return None  # nothing to go by: the broker places as on any host
        return names[:MAX_VISIBLE]
    return [part.strip() for part in value.split(",") if part.strip()][:MAX_VISIBLE]


def cuda_initialised() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:  # pragma: no cover - not Linux
        return "cupy" in sys.modules or "torch" in sys.modules


def bind(placement: Placement, *, simulated: bool) -> Binding:
    """Apply ``placement`` to this process; raise BindingError if it cannot be honoured.

    A MIG instance can only be reached through ``CUDA_VISIBLE_DEVICES``, set before CUDA
    starts; the process is then pinned to it.  A whole GPU is *selected* instead (every
    GPU stays visible, numbered in PCI order like NVML), so the next cell's lease may
    land on another GPU: late binding.
    """
    if simulated:
        return Binding(
            visible="", ordinal=placement.device_index, how="simulated GPU: no binding needed"
        )
    current = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    initialised = cuda_initialised()
    if placement.mig_uuid:
        target = placement.mig_uuid
        if current == target:
            return Binding(visible=target, ordinal=0, how=f"already bound to {target}")
        if initialised:
            raise BindingError(
                f"the lease is on MIG instance {target}, which this process cannot reach "
                "because CUDA was initialised before the lease; restart the kernel "
                "(Kernel > Restart) and run the %%gpu cell before any other CUDA code"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = target
        return Binding(visible=target, ordinal=0, how=f"CUDA_VISIBLE_DEVICES={target}")
    if current:
        # Someone (an admin, a container runtime) restricted the GPUs: use what we see.
        if current in (placement.device_uuid, str(placement.device_index)) and "," not in current:
            return Binding(visible=current, ordinal=0, how=f"CUDA_VISIBLE_DEVICES={current}")
        if not initialised:
            raise BindingError(
                f"CUDA_VISIBLE_DEVICES={current} hides {placement.device_uuid}, the GPU of the "
                "lease; unset it in the kernel's environment or ask for device=0"
            )
        ordinal = _ordinal_of(placement.device_uuid)
        _select(ordinal)
        return Binding(visible=current, ordinal=ordinal, how=f"selected CUDA device {ordinal}")
    if placement.mps:
        note = apply_mps_limits(placement, initialised)
        if note:
            raise BindingError(note)
    if not initialised:
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA ordinals = NVML indices
        ordinal = placement.device_index
    else:
        ordinal = _ordinal_of(placement.device_uuid)
    _select(ordinal, bring_up=True)
    return Binding(
        visible="",
        ordinal=ordinal,
        how=f"selected GPU {placement.device_index} (CUDA device {ordinal})",
    )


def apply_mps_limits(placement: Placement, initialised: bool) -> str:
    """Turn the lease's SM share and memory into this MPS client's limits.

    MPS reads them when the client connects, i.e. at CUDA initialisation; returns a
    sentence explaining the problem when it is too late, "" when applied.
    """
    percentage = str(max(1, round(placement.sm_share * 100)))
    limit = f"{placement.device_index}={placement.memory_bytes >> 20}M"
    wanted = {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percentage,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": limit,
    }
    if initialised:
        if all(os.environ.get(key) == value for key, value in wanted.items()):
            return ""
        return (
            f"this MPS client started CUDA before the lease; its limits ({percentage} % of the "
            f"SMs, {placement.memory_bytes >> 20} MiB) apply only from the start: restart the "
            "kernel and run the %%gpu cell first"
        )
    os.environ.update(wanted)
    return ""


def _ordinal_of(uuid: str) -> int:
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise BindingError(f"cannot start CUDA: {err}")
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise BindingError(f"cannot count CUDA devices: {err}")
    wanted = uuid.removeprefix("GPU-").replace("-", "").lower()
    for ordinal in range(count):
        _, device = cu.cuDeviceGet(ordinal)
        _, raw = cu.cuDeviceGetUuid(device)
        if bytes(raw.bytes).hex() == wanted:
            return ordinal
    raise BindingError(f"no CUDA device of this process has UUID {uuid}; restart the kernel")


def _select(ordinal: int, bring_up: bool = False) -> None:
    """Make ``ordinal`` the current device of every framework this process uses (the
    cell runs on this thread); ``bring_up``: also of a framework not imported yet that
    the session's gate needs.  PyTorch code should use ``gpushare_ext.device()``."""
    global current_ordinal
    current_ordinal = ordinal
    frameworks.select_device(ordinal, bring_up)
