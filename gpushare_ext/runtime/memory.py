"""Memory quotas inside the kernel process: CuPy's allocator and a Numba EMM plugin.

The lease says how much device memory the session may hold.  :class:`QuotaLedger`
keeps the count (pure Python, tested without a GPU); :func:`install_cupy_quota` puts a
checking allocator in front of CuPy's memory pool and :class:`QuotaMemoryManager` is
a Numba external memory manager (EMM) doing the same for ``numba.cuda``.  Going over
the quota raises :class:`QuotaExceeded` (a MemoryError) naming quota and usage; nothing
is allocated.  Work that bypasses both hooks (PyTorch) is caught by the broker's NVML
watchdog instead.
"""

from __future__ import annotations

import threading
from typing import Any

from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.units import format_size


class QuotaExceeded(SessionError, MemoryError):
    """An allocation would take the session over its lease's memory."""

    def __init__(self, requested: int, used: int, quota: int, where: str) -> None:
        super().__init__(
            f"gpushare: {where} allocation of {format_size(requested)} refused: the lease allows "
            f"{format_size(quota)} and {format_size(used)} is already in use. Free arrays "
            "(del x; cupy.get_default_memory_pool().free_all_blocks()) or ask for more "
            "memory: %%gpu mem=..."
        )
        self.requested = requested
        self.used = used
        self.quota = quota


class QuotaLedger:
    """Bytes held against a quota; thread-safe.  A quota of None means unlimited."""

    def __init__(self, quota: int | None = None) -> None:
        self.quota = quota
        self._used_elsewhere = 0  # Numba's share; CuPy's comes from its pool
        self._lock = threading.Lock()

    def set_quota(self, quota: int | None) -> None:
        with self._lock:
            self.quota = quota

    def check(self, requested: int, in_use: int, where: str) -> None:
        with self._lock:
            used = in_use + self._used_elsewhere
            if self.quota is not None and used + requested > self.quota:
                raise QuotaExceeded(requested, used, self.quota, where)

    def take(self, size: int, in_use: int, where: str) -> None:
        with self._lock:
            used = in_use + self._used_elsewhere
            if self.quota is not None and used + size > self.quota:
                raise QuotaExceeded(size, used, self.quota, where)
            self._used_elsewhere += size

    def give_back(self, size: int) -> None:
        with self._lock:
            self._used_elsewhere = max(0, self._used_elsewhere - size)

    @property
    def numba_bytes(self) -> int:
        return self._used_elsewhere


LEDGER = QuotaLedger()
_cupy_installed = False


def _cupy_in_use() -> int:
    import cupy

    return int(cupy.get_default_memory_pool().used_bytes())


def install_cupy_quota() -> bool:
    """Route CuPy allocations through the ledger; False if CuPy is not importable."""
    global _cupy_installed
    if _cupy_installed:
        return True
    try:
        import cupy
    except ImportError:
        return False
    pool = cupy.get_default_memory_pool()

    def allocate(size: int) -> Any:
        LEDGER.check(size, int(pool.used_bytes()), "CuPy")
        try:
            return pool.malloc(size)
        except cupy.cuda.memory.OutOfMemoryError:
            pool.free_all_blocks()
            return pool.malloc(size)

    cupy.cuda.set_allocator(allocate)
    _cupy_installed = True
    return True


def apply_quota(quota: int | None) -> None:
    """Set the quota for the current lease (None when no lease is held)."""
    LEDGER.set_quota(quota)
    if _cupy_installed:
        import cupy

        # CuPy's own limit is the backstop for allocations that skip our allocator.
        cupy.get_default_memory_pool().set_limit(size=quota or 0)


def numba_memory_manager():
    """The Numba EMM class enforcing the ledger; import only where numba-cuda is installed."""
    from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager

    class QuotaMemoryManager(NumbaCUDAMemoryManager):
        """Numba's default memory manager with every allocation checked against the lease."""

        def memalloc(self, size):
            in_use = _cupy_in_use() if _cupy_installed else 0
            LEDGER.take(size, in_use, "Numba")
            try:
                memory = super().memalloc(size)
            except BaseException:
                LEDGER.give_back(size)
                raise
            import weakref

            weakref.finalize(memory, LEDGER.give_back, size)
            return memory

    return QuotaMemoryManager


NUMBA_MANAGER_ENV = "NUMBA_CUDA_MEMORY_MANAGER"


def install_numba_quota() -> bool:
    """Make Numba allocate through :class:`QuotaMemoryManager`.

    Numba reads ``NUMBA_CUDA_MEMORY_MANAGER`` (a module with ``_numba_memory_manager``)
    when it is imported, so the variable covers a later ``import numba``; if Numba is
    already imported, the manager is set directly.  Either must happen before Numba
    creates its CUDA context; False when that moment has passed.
    """
    import os
    import sys

    os.environ.setdefault(NUMBA_MANAGER_ENV, __name__)
    if "numba.cuda" not in sys.modules:
        return True
    from numba import cuda

    try:
        cuda.set_memory_manager(numba_memory_manager())
    except Exception:  # a context exists already: Numba refuses a new manager
        return False
    return True


def __getattr__(name: str):
    # Numba imports this module by the name in NUMBA_CUDA_MEMORY_MANAGER and asks for
    # ``_numba_memory_manager``; build the class only then (it needs numba-cuda).
    if name == "_numba_memory_manager":
        return numba_memory_manager()
    raise AttributeError(name)
