"""The memory quota ledger: what a lease allows, what is in use, and the error a user reads
when an allocation would go over (a MemoryError naming quota and usage)."""

from __future__ import annotations

import threading

import pytest

from gpushare_ext.runtime.memory import QuotaExceeded, QuotaLedger

GIB = 1024**3
MIB = 1024**2


def test_within_the_quota_nothing_is_refused():
    ledger = QuotaLedger(quota=2 * GIB)
    ledger.check(1 * GIB, in_use=1 * GIB, where="CuPy")  # exactly full is fine
    ledger.take(512 * MIB, in_use=0, where="Numba")
    assert ledger.numba_bytes == 512 * MIB


def test_over_the_quota_raises_a_memory_error_naming_quota_and_usage():
    ledger = QuotaLedger(quota=1 * GIB)
    with pytest.raises(MemoryError) as caught:
        ledger.check(2 * GIB, in_use=256 * MIB, where="CuPy")
    error = caught.value
    assert isinstance(error, QuotaExceeded)
    message = str(error)
    assert "CuPy allocation of 2.0 GiB refused" in message
    assert "the lease allows 1.0 GiB" in message
    assert "256 MiB is already in use" in message
    assert "%%gpu mem=" in message  # says how to get more
    assert (error.requested, error.used, error.quota) == (2 * GIB, 256 * MIB, 1 * GIB)


def test_numba_and_cupy_usage_count_together():
    ledger = QuotaLedger(quota=1 * GIB)
    ledger.take(600 * MIB, in_use=0, where="Numba")
    with pytest.raises(QuotaExceeded) as caught:
        ledger.check(500 * MIB, in_use=0, where="CuPy")  # 600 MiB held by Numba
    assert caught.value.used == 600 * MIB
    with pytest.raises(QuotaExceeded):
        ledger.take(100 * MIB, in_use=400 * MIB, where="Numba")  # 400 MiB held by CuPy


def test_a_refused_take_books_nothing():
    ledger = QuotaLedger(quota=1 * GIB)
    with pytest.raises(QuotaExceeded):
        ledger.take(2 * GIB, in_use=0, where="Numba")
    assert ledger.numba_bytes == 0


def test_giving_back_frees_room_and_never_goes_negative():
    ledger = QuotaLedger(quota=1 * GIB)
    ledger.take(1 * GIB, in_use=0, where="Numba")
    with pytest.raises(QuotaExceeded):
        ledger.take(1, in_use=0, where="Numba")
    ledger.give_back(1 * GIB)
    ledger.take(1 * GIB, in_use=0, where="Numba")
    ledger.give_back(5 * GIB)
    assert ledger.numba_bytes == 0


def test_no_quota_means_unlimited_and_the_quota_follows_the_lease():
    ledger = QuotaLedger()
    ledger.check(1 << 50, in_use=1 << 50, where="CuPy")
    ledger.set_quota(1 * GIB)
    with pytest.raises(QuotaExceeded):
        ledger.check(2 * GIB, in_use=0, where="CuPy")
    ledger.set_quota(None)
    ledger.check(2 * GIB, in_use=0, where="CuPy")


def test_concurrent_takes_never_overbook():
    ledger = QuotaLedger(quota=100 * MIB)
    granted = []

    def worker():
        for _ in range(50):
            try:
                ledger.take(1 * MIB, in_use=0, where="Numba")
            except QuotaExceeded:
                continue
            granted.append(1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(granted) == 100
    assert ledger.numba_bytes == 100 * MIB
