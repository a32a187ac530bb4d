"""CuPy under gpushare: its device, its memory pool under the lease's quota, and PTX.

CuPy's allocations go through a checking allocator in front of its default memory
pool (the pool's own limit is the backstop), and kernels the server starts compile
their CuPy kernels to PTX (``CUPY_COMPILE_WITH_PTX=1``), which the launch shim hands to
the preemptible-kernel analysis, so long ones can be stopped mid-kernel.

It must not import CuPy until a hook is called.
"""

from __future__ import annotations

import sys
from typing import Any

from gpushare_ext.runtime import memory
from gpushare_ext.runtime.frameworks.framework import Framework

_installed = False


def select_device(ordinal: int, bring_up: bool) -> None:
    """CuPy's current device; CuPy is imported for it when ``bring_up`` (the session's
    gate stream is a CuPy stream)."""
    if "cupy" in sys.modules or bring_up:
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            cupy.cuda.Device(ordinal).use()


def install_quota() -> bool:
    """Route CuPy allocations through the ledger; False if CuPy is not importable."""
    global _installed
    if _installed:
        return True
    try:
        import cupy
    except ImportError:
        return False
    pool = cupy.get_default_memory_pool()

    def allocate(size: int) -> Any:
        memory.LEDGER.check(size, int(pool.used_bytes()), "CuPy")
        try:
            return pool.malloc(size)
        except cupy.cuda.memory.OutOfMemoryError:
            pool.free_all_blocks()
            return pool.malloc(size)

    cupy.cuda.set_allocator(allocate)
    # CuPy's own limit is the backstop for allocations that skip our allocator.
    memory.add_pool(
        in_use=lambda: int(pool.used_bytes()),
        set_limit=lambda quota: pool.set_limit(size=quota or 0),
    )
    _installed = True
    return True


FRAMEWORK = Framework(
    name="cupy",
    select_device=select_device,
    install_quota=install_quota,
    kernel_environment={"CUPY_COMPILE_WITH_PTX": "1"},
)
