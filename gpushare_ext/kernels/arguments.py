"""A launch's arguments, packed as the kernel's PTX parameters.

What it is for: :func:`bind_arguments` turns the user's arguments (device arrays with
``__cuda_array_interface__``, Python and NumPy scalars, raw bytes) into one value per PTX
parameter and the extent of every buffer passed (:class:`BoundArgs`: what the analysis
classifies a launch by and a snapshot copies); Numba's flattened arrays expand to their
fields.  Also the ``kernelParams`` array of ``cuLaunchKernel`` and grid/block shapes.

What it must not do: call the CUDA driver, or read the buffers it describes.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpushare_ext.kernels.ptx import KernelError, Param

__all__ = [
    "BoundArgs",
    "array_extent",
    "bind_arguments",
    "dim3",
    "is_device_array",
    "param_array",
]

_PACK = {
    "u8": "B", "s8": "b", "b8": "B", "u16": "H", "s16": "h", "b16": "H", "f16": "e",
    "u32": "I", "s32": "i", "b32": "I", "f32": "f",
    "u64": "Q", "s64": "q", "b64": "Q", "f64": "d",
}  # fmt: skip


def is_device_array(value: Any) -> bool:
    return hasattr(value, "__cuda_array_interface__")


def array_extent(value: Any) -> tuple[int, int]:
    """(lowest address, bytes spanned) of a device array, any strides."""
    cai = value.__cuda_array_interface__
    ptr = int(cai["data"][0])
    shape = tuple(cai["shape"])
    import numpy as np

    itemsize = np.dtype(cai["typestr"]).itemsize
    if any(s == 0 for s in shape):
        return ptr, 0
    strides = cai.get("strides") or None
    if strides is None:
        n = itemsize
        for s in shape:
            n *= s
        return ptr, n
    lo = hi = 0
    for s, st in zip(shape, strides, strict=True):
        if st >= 0:
            hi += (s - 1) * st
        else:
            lo += (s - 1) * st
    return ptr + lo, hi - lo + itemsize


def _scalar(value: Any, p: Param) -> bytes:
    fmt = _PACK.get(p.type)
    if fmt is None or p.array is not None:
        if isinstance(value, (bytes, bytearray)) and len(value) == p.size:
            return bytes(value)
        raise KernelError(
            "bad-argument", f"parameter {p.name} ({p.type}[{p.array}]) needs {p.size} raw bytes"
        )
    if hasattr(value, "item"):
        value = value.item()
    if fmt in "efd":
        return struct.pack("<" + fmt, float(value))
    v = int(value)
    if fmt.isupper():
        v &= (1 << (8 * struct.calcsize(fmt))) - 1
    return struct.pack("<" + fmt, v)


@dataclass
class BoundArgs:
    values: list[bytes]  # one per original PTX parameter
    extents: dict[str, tuple[int, int]]  # pointer param -> (address, nbytes)
    arrays: dict[str, Any]  # pointer param -> the user's array


def bind_arguments(kernel: Any, args: Sequence[Any]) -> BoundArgs:
    entry = kernel.entry
    bindings = kernel.bindings
    if len(args) != len(bindings):
        names = ", ".join(b.name for b in bindings)
        raise KernelError(
            "bad-argument",
            f"{entry.name} takes {len(bindings)} arguments ({names}), got {len(args)}",
        )
    values: dict[str, bytes] = {}
    extents: dict[str, tuple[int, int]] = {}
    arrays: dict[str, Any] = {}
    for b, a in zip(bindings, args, strict=True):
        if b.kind == "numba-array":
            if not is_device_array(a):
                raise KernelError("bad-argument", f"argument {b.name} must be a device array")
            cai = a.__cuda_array_interface__
            import numpy as np

            itemsize = np.dtype(cai["typestr"]).itemsize
            shape = tuple(cai["shape"])
            strides = cai.get("strides") or _c_strides(shape, itemsize)
            nitems = 1
            for s in shape:
                nitems *= s
            ptr = int(cai["data"][0])
            fields = [0, 0, nitems, itemsize, ptr, *shape, *strides]
            for p, v in zip(b.params, fields, strict=True):
                values[p] = _scalar(v, entry.param(p))
            extents[b.data_param] = array_extent(a)
            arrays[b.data_param] = a
        else:
            p = entry.param(b.params[0])
            if is_device_array(a):
                ptr, n = array_extent(a)
                values[p.name] = struct.pack("<Q", int(a.__cuda_array_interface__["data"][0]))
                extents[p.name] = (ptr, n)
                arrays[p.name] = a
            else:
                values[p.name] = _scalar(a, p)
    return BoundArgs([values[p.name] for p in entry.params], extents, arrays)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def param_array(values: Sequence[bytes]) -> tuple[Any, Any]:
    """``kernelParams`` for cuLaunchKernel: one host buffer holding every value (each at a
    16-byte aligned offset) and the array of pointers into it. Keep both alive until the
    launch call returns (the driver copies the values during the call)."""
    offsets = []
    blob = bytearray()
    for v in values:
        offsets.append(len(blob))
        blob += v
        blob += b"\0" * (-len(blob) % 16)
    buf = ctypes.create_string_buffer(bytes(blob), max(len(blob), 8))
    base = ctypes.addressof(buf)
    ptrs = (ctypes.c_void_p * max(len(values), 1))(*[base + o for o in offsets])
    return ptrs, buf


def dim3(v: Any) -> tuple[int, int, int]:
    if isinstance(v, int):
        return (v, 1, 1)
    t = tuple(int(x) for x in v)
    return (*t, 1, 1, 1)[:3]  # type: ignore[return-value]
