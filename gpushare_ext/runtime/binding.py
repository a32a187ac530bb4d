"""Device binding: make this kernel process use the GPU or MIG instance its lease names.

Before the process's first CUDA call the binding is an environment variable
(``CUDA_VISIBLE_DEVICES=<GPU or MIG UUID>``); CUDA reads it once, at initialisation.
If CUDA is already initialised with every device visible, the binding selects the
device for CuPy and Numba instead.  If neither can honour the lease (CUDA already
bound to another device, or a MIG instance that the process cannot see) the binding
says why and how to fix it: restart the kernel.

Whether CUDA was initialised is read from ``/proc/self/maps``: if ``libcuda`` is not
mapped, nothing in this process has called the driver yet.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from gpushare_ext.protocol import Placement


class BindingError(Exception):
    """The lease's device cannot be used by this process; the message says how to fix it."""


@dataclass(frozen=True)
class Binding:
    visible: str  # what CUDA_VISIBLE_DEVICES names (a UUID), or "" when all are visible
    ordinal: int  # CUDA device ordinal to use inside this process
    how: str  # one sentence for the user


def cuda_initialised() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:  # pragma: no cover - not Linux
        return "cupy" in sys.modules or "torch" in sys.modules


_bound_to: str | None = None


def bind(placement: Placement, *, simulated: bool) -> Binding:
    """Apply ``placement`` to this process; raise BindingError if it cannot be honoured."""
    global _bound_to
    target = placement.cuda_visible_devices
    if simulated:
        return Binding(
            visible="", ordinal=placement.device_index, how="simulated GPU: no binding needed"
        )
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not cuda_initialised():
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = target
        _bound_to = target
        return Binding(visible=target, ordinal=0, how=f"CUDA_VISIBLE_DEVICES={target}")
    if current is not None and current.strip():
        if current == target:
            return Binding(visible=target, ordinal=0, how=f"already bound to {target}")
        raise BindingError(
            f"this kernel already uses CUDA on {current}, but the lease is on {target}; "
            "CUDA cannot switch devices once initialised with a fixed set: restart the kernel "
            "(Kernel > Restart) and run the %%gpu cell before any other CUDA code"
        )
    if placement.mig_uuid:
        raise BindingError(
            f"the lease is on MIG instance {placement.mig_uuid}, which this process cannot see "
            "because CUDA was initialised before the lease; restart the kernel and run the "
            "%%gpu cell before any other CUDA code"
        )
    ordinal = _ordinal_of(placement.device_uuid)
    _select(ordinal)
    return Binding(
        visible="", ordinal=ordinal, how=f"selected CUDA device {ordinal} for CuPy/Numba"
    )


def _ordinal_of(uuid: str) -> int:
    from cuda.bindings import driver as cu

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


def _select(ordinal: int) -> None:
    if "cupy" in sys.modules:
        import cupy

        cupy.cuda.Device(ordinal).use()
    if "numba.cuda" in sys.modules:
        from numba import cuda

        cuda.select_device(ordinal)
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.set_device(ordinal)
