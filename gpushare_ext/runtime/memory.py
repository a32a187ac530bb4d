"""Memory quotas inside the kernel process: the ledger every framework's hook checks.

The lease says how much device memory the session may hold.  :class:`QuotaLedger`
keeps the count (pure Python, tested without a GPU); each framework's quota hook
(``frameworks/``: a checking allocator in front of CuPy's pool, a Numba external memory
manager) checks its allocations against :data:`LEDGER`.  Going over the quota raises
:class:`QuotaExceeded` (a MemoryError) naming quota and usage; nothing is allocated.
Work that bypasses every hook (PyTorch) is caught by the broker's NVML watchdog instead.

It must not import or name a framework: each framework's module registers its pool here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

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
# Frameworks that allocate from a pool of their own (CuPy): what each pool holds, and
# the pool's own limit, the backstop for allocations that skip the checking allocator.
_pools: list[tuple[Callable[[], int], Callable[[int | None], None]]] = []


def add_pool(*, in_use: Callable[[], int], set_limit: Callable[[int | None], None]) -> None:
    """A framework's pool, counted by its allocator and limited with the quota."""
    _pools.append((in_use, set_limit))


def pooled_bytes() -> int:
    """What the frameworks' pools hold: the usage an allocation outside them adds to."""
    return sum(in_use() for in_use, _ in _pools)


def apply_quota(quota: int | None) -> None:
    """Set the quota for the current lease (None when no lease is held)."""
    LEDGER.set_quota(quota)
    for _, set_limit in _pools:
        set_limit(quota)
