"""Preemptible kernels on a real GPU: bit-exact results under preemption, rollback, fences.

Marked ``gpu``; skips cleanly without a GPU or CuPy. Failures print what differs (kernel,
mode, argument, first differing index, values) because GPU time to debug is scarce.
The whole file is meant to run in well under a minute on an H200.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from corpus_specs import CASES, Case

from gpushare_ext.kernels import kernel
from gpushare_ext.kernels.report import Idempotence


def _gpu_ready() -> str | None:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"cuInit failed: {err}"
        err, n = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or n == 0:
            return "no CUDA device"
        import cupy  # noqa: F401
    except Exception as exc:
        return f"no usable GPU: {type(exc).__name__}: {exc}"
    return None


_WHY = _gpu_ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

RUNNABLE = [
    c for c in CASES if c.make_args is not None and c.refuse is None and c.kernel != "smid_probe"
]


def _kernel(case: Case):
    return kernel(case.source, case.kernel)


def _fresh(cp, args):
    return tuple(a.copy() if hasattr(a, "__cuda_array_interface__") else a for a in args)


def _compare(cp, case: Case, what: str, got: tuple, want: tuple, report=None) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not hasattr(g, "__cuda_array_interface__"):
            continue
        gh, wh = cp.asnumpy(g), cp.asnumpy(w)
        if gh.tobytes() == wh.tobytes():
            continue
        gv, wv = gh.view(np.uint8).reshape(-1), wh.view(np.uint8).reshape(-1)
        bad = np.flatnonzero(gh.reshape(-1) != wh.reshape(-1))
        first = int(bad[0]) if bad.size else int(np.flatnonzero(gv != wv)[0]) // gh.itemsize
        pytest.fail(
            f"{case.id} [{what}]: argument {i} differs in {bad.size} of {gh.size} elements; "
            f"first at {first}: got {gh.reshape(-1)[first]!r}, want {wh.reshape(-1)[first]!r}\n"
            f"launch report: {report}"
        )


@pytest.mark.parametrize("case", RUNNABLE, ids=lambda c: c.id)
def test_results_are_bit_identical_after_preemptions(case: Case):
    import cupy as cp

    rng = np.random.default_rng(abs(hash(case.id)) % (1 << 32))
    k = _kernel(case)
    inputs = case.make_args(cp, rng)
    want = _fresh(cp, inputs)
    k.launch(case.grid, case.block, want, mode="off", shared_mem=case.shared)
    cp.cuda.Device().synchronize()
    total = case.grid[0] * case.grid[1] * case.grid[2]
    for n, max_blocks in ((1, None), (10, 7), (100, 3)):
        cuts = sorted(
            rng.choice(np.arange(1, total), size=min(n, total - 1), replace=False).tolist()
        )
        got = _fresh(cp, inputs)
        rep = k.launch(case.grid, case.block, got, shared_mem=case.shared, preempt_at=cuts,
                       max_blocks=max_blocks)  # fmt: skip
        assert rep.mode.value != "off", rep.notes
        assert rep.yields == len(cuts), rep
        _compare(
            cp,
            case,
            f"{len(cuts)} yields, {rep.persistent_blocks} persistent blocks",
            got,
            want,
            rep,
        )
    # Forced chunk sizes (logical blocks per claim); 128 is not a multiple of 3, and the
    # random cuts split chunks, so clipping at `stop` and at the end is exercised.
    for chunk in (1, 3, 16):
        cuts = sorted(
            rng.choice(np.arange(1, total), size=min(5, total - 1), replace=False).tolist()
        )
        got = _fresh(cp, inputs)
        rep = k.launch(case.grid, case.block, got, shared_mem=case.shared, preempt_at=cuts,
                       max_blocks=3, chunk=chunk)  # fmt: skip
        assert rep.chunk == chunk and rep.yields == len(cuts), rep
        _compare(cp, case, f"chunk {chunk}, {len(cuts)} yields", got, want, rep)
    if case.aborts_ok:
        for n_aborts in (1, 3):
            cuts = rng.integers(1, total, size=n_aborts).tolist()
            got = _fresh(cp, inputs)
            rep = k.launch(case.grid, case.block, got, shared_mem=case.shared, abort_at=cuts,
                           preempt_at=[total // 2])  # fmt: skip
            expected_mode = "resume" if k.report.classification.idempotent else "snapshot"
            assert rep.mode.value == expected_mode, rep
            assert rep.aborts == n_aborts, rep
            _compare(cp, case, f"{n_aborts} aborts then {rep.mode.value}", got, want, rep)


@pytest.mark.parametrize("chunk", [1, 3, 16, None])
def test_chunked_claiming_with_an_uneven_block_count(chunk):
    """saxpy (in place, snapshot mode) on 1001 logical blocks (a multiple of neither 3 nor
    16): cuts, an abort and the adaptive choice (None) all give the original's bytes."""
    import cupy as cp

    case = next(c for c in CASES if c.kernel == "saxpy")
    k = _kernel(case)
    blocks = 1001
    n = blocks * 256 - 17  # the last block is partly idle
    rng = np.random.default_rng(5)
    x = cp.asarray(rng.standard_normal(n).astype(np.float32))
    y0 = cp.asarray(rng.standard_normal(n).astype(np.float32))
    want = y0.copy()
    k.launch((blocks,), (256,), (np.float32(1.5), x, want, np.int32(n)), mode="off")
    for kw in ({}, {"preempt_at": [1, 2, 500, 998, 1000]}, {"abort_at": [333], "preempt_at": [7]}):
        for _ in range(2):  # the second launch uses the measured block time (chunk=None)
            got = y0.copy()
            rep = k.launch((blocks,), (256,), (np.float32(1.5), x, got, np.int32(n)),
                           max_blocks=5, chunk=chunk, **kw)  # fmt: skip
            if chunk is not None:
                assert rep.chunk == chunk, rep
            assert 1 <= rep.chunk <= 64, rep
            _compare(cp, case, f"chunk {chunk} -> {rep.chunk}, {kw}", (got,), (want,), rep)


def test_real_yield_flag_with_chunks_drains_and_resumes_exactly():
    import cupy as cp

    from gpushare_ext.kernels.yield_flags import YieldFlag

    case = next(c for c in CASES if c.kernel == "long_loop")
    k = _kernel(case)
    blocks = 1003
    x = cp.asarray(np.random.default_rng(3).standard_normal(blocks * 256).astype(np.float32))
    iters = np.int32(20000)
    want = cp.zeros_like(x)
    k.launch((blocks,), case.block, (x, want, np.int32(x.size), iters), mode="off")
    flag = YieldFlag()
    for chunk in (3, 16):
        got = cp.zeros_like(x)

        def preempt() -> None:
            time.sleep(0.002)
            flag.set(1)
            time.sleep(0.003)
            flag.clear()

        t = threading.Thread(target=preempt)
        t.start()
        rep = k.launch((blocks,), case.block, (x, got, np.int32(x.size), iters), max_blocks=2,
                       yield_flag=flag, chunk=chunk)  # fmt: skip
        t.join()
        _compare(cp, case, f"real flag yield, chunk {chunk}", (got,), (want,), rep)
        print(f"real yield, chunk {chunk}: {rep}")
    flag.close()


def test_aliased_buffers_are_snapshotted_and_stay_exact():
    import cupy as cp

    case = next(c for c in CASES if c.kernel == "copy_shift")
    k = _kernel(case)
    x = cp.arange(case.grid[0] * 256, dtype=cp.float32)
    want = x + 1
    rep = k.launch(
        case.grid, case.block, (x, x, np.int32(x.size)), abort_at=[40], preempt_at=[9, 77]
    )
    assert rep.classification.verdict is Idempotence.NON_IDEMPOTENT, rep
    assert rep.mode.value == "snapshot" and rep.restored, rep
    _compare(cp, case, "in place through aliasing", (x,), (want,), rep)


def test_real_yield_flag_drains_and_resumes_exactly():
    import cupy as cp

    from gpushare_ext.kernels.yield_flags import YieldFlag

    case = next(c for c in CASES if c.kernel == "long_loop")
    k = _kernel(case)
    x = cp.asarray(np.random.default_rng(1).standard_normal(case.grid[0] * 256).astype(np.float32))
    iters = np.int32(20000)
    want = cp.zeros_like(x)
    k.launch(case.grid, case.block, (x, want, np.int32(x.size), iters), mode="off")
    flag = YieldFlag()
    got = cp.zeros_like(x)

    def preempt() -> None:
        time.sleep(0.002)
        flag.set(1)
        time.sleep(0.003)
        flag.clear()

    t = threading.Thread(target=preempt)
    t.start()
    rep = k.launch(case.grid, case.block, (x, got, np.int32(x.size), iters), max_blocks=2,
                   yield_flag=flag)  # fmt: skip
    t.join()
    _compare(cp, case, "real flag yield", (got,), (want,), rep)
    print(f"real yield: {rep}")
    assert rep.yields >= 1, f"the kernel finished before the flag landed: {rep}"
    assert rep.first_yield_ns is not None and rep.last_exit_ns >= rep.first_yield_ns, rep
    flag.close()


def test_interrupt_mid_launch_restores_a_non_idempotent_kernel(monkeypatch):
    import cupy as cp

    import gpushare_ext.kernels.driver as driver

    case = next(c for c in CASES if c.kernel == "long_loop_inplace")
    k = _kernel(case)
    x = cp.asarray(np.random.default_rng(2).standard_normal(case.grid[0] * 256).astype(np.float32))
    before = x.copy()
    real_wait = driver.wait_for_stream
    calls = {"n": 0}

    def interrupted_wait(stream, on_tick=None):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(0.003)  # let it write part of x
            raise KeyboardInterrupt
        return real_wait(stream, on_tick)

    monkeypatch.setattr(driver, "wait_for_stream", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        k.launch(case.grid, case.block, (x, np.int32(x.size), np.int32(200000)), max_blocks=2)
    monkeypatch.setattr(driver, "wait_for_stream", real_wait)
    rep = k.last_launch
    assert rep.mode.value == "snapshot" and rep.restored, rep
    _compare(cp, case, "after Ctrl-C", (x,), (before,), rep)


def test_fence_neutralises_an_out_of_bounds_store_and_counts_it():
    import cupy as cp

    case = next(c for c in CASES if c.kernel == "oob_store")
    k = _kernel(case)
    n = 128 * 256
    pool = cp.zeros(3 * n, dtype=cp.float32)
    a = pool[n : 2 * n]
    rep = k.launch((128,), (256,), (a, np.int32(n), np.int32(5)), fence=True)
    host = cp.asnumpy(pool)
    assert (host[n : 2 * n] == 1).all(), "the in-bounds stores must land"
    assert not host[:n].any() and not host[2 * n :].any(), (
        f"a neighbour was written: {np.flatnonzero(host[:n])[:5]}, {np.flatnonzero(host[2 * n :])[:5]}"
    )
    assert rep.fenced_accesses == 1, rep
    # Without the fence the same launch does corrupt the neighbour (the test can fail).
    pool[:] = 0
    k.launch((128,), (256,), (a, np.int32(n), np.int32(5)), mode="off")
    assert float(pool[2 * n + 5]) == 42.0


def test_sm_share_limits_the_sms_used():
    import cupy as cp

    case = next(c for c in CASES if c.kernel == "smid_probe")
    k = _kernel(case)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.full(1024, 0xFFFFFFFF, dtype=cp.uint32)
    rep = k.launch((1024,), (128,), (out,), sm_share=0.25)
    used = set(cp.asnumpy(out).tolist())
    assert 0xFFFFFFFF not in used, "every logical block must have run"
    assert rep.persistent_blocks == max(1, int(0.25 * sms)), rep
    assert len(used) <= rep.persistent_blocks, (len(used), rep)
    out[:] = 0xFFFFFFFF
    rep = k.launch((1024,), (128,), (out,), max_blocks=3)
    assert len(set(cp.asnumpy(out).tolist())) <= 3, rep


def test_yield_flag_written_from_another_process_through_ipc():
    from gpushare_ext.kernels.yield_flags import YieldFlag

    flag = YieldFlag()
    handle = flag.ipc_handle().hex()
    code = (
        "from gpushare_ext.kernels.yield_flags import write_yield_flag_from_handle as w;"
        f"w(bytes.fromhex('{handle}'), 7, 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert flag.read() == 7
    flag.close()


def test_the_actuator_opens_a_registered_flag_ahead_and_a_pause_then_writes_it():
    from gpushare_ext.broker.hands.actuators import CudaProcessControl
    from gpushare_ext.kernels.yield_flags import YieldFlag

    flag = YieldFlag()
    control = CudaProcessControl([0])
    try:
        handle = flag.ipc_handle().hex()
        control.open_yield_flag(0, handle, 0)  # what registering the flag starts
        assert flag.read() == 0  # opening writes nothing
        control.write_yield_flag(0, handle, 0, 3)  # what a pause does
        assert flag.read() == 3
    finally:
        control.close()
        flag.close()


class _Toggler:
    """Raise ``flag`` for ``on_s`` every ``period_s`` while a launch runs."""

    def __init__(self, flag, on_s: float = 0.001, period_s: float = 0.004) -> None:
        self.flag, self.on_s, self.period_s = flag, on_s, period_s
        self.stop = threading.Event()
        self.raised = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            time.sleep(self.period_s)
            self.flag.set(1)
            self.raised += 1
            time.sleep(self.on_s)
            self.flag.clear()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.flag.clear()


def _assert_stop_marks_in_order(rep) -> None:
    """Every stopped slice's marks (written once per parked block): it began, then a
    thread saw the flag, then the last block left, all within the launch's time."""
    assert len(rep.stops_ns) >= rep.saves, rep
    for start, first, last in rep.stops_ns:
        assert 0 < start <= first <= last < start + 60_000_000_000, (start, first, last)


def test_saved_aborts_keep_the_work_of_logical_blocks_longer_than_every_gap():
    """long_loop_inplace (not idempotent) on two persistent blocks that each run one
    logical block of far more than the 4 ms between preemptions: with saved state the
    launch finishes while preemptions go on, nothing is rolled back, and the bytes are
    those of an undisturbed run."""
    import cupy as cp

    from gpushare_ext.kernels.yield_flags import YieldFlag

    case = next(c for c in CASES if c.kernel == "long_loop_inplace")
    k = _kernel(case)
    variant = k.preemptible(abort_checks=True)
    assert variant.saves_state, variant.save_refusal
    x0 = cp.asarray(np.random.default_rng(5).standard_normal(2 * 256).astype(np.float32))
    iters = np.int32(20_000_000)  # tens of milliseconds for one logical block
    want = x0.copy()
    k.launch((2,), (256,), (want, np.int32(want.size), iters), mode="off")
    cp.cuda.Device().synchronize()
    flag = YieldFlag()
    got = x0.copy()
    with _Toggler(flag) as toggler:
        # Without saved state this would restart for as long as the preemptions go on.
        rep = k.launch((2,), (256,), (got, np.int32(got.size), iters), abort_checks=True,
                       yield_flag=flag)  # fmt: skip
    print(f"saved aborts: {rep}")
    assert toggler.raised >= 3, rep
    assert rep.saves >= 2 and rep.aborts == 0 and not rep.restored, rep
    _assert_stop_marks_in_order(rep)
    _compare(cp, case, "saved aborts", (got,), (want,), rep)
    flag.close()


ATOMIC_LOOP = r"""
extern "C" __global__ void count_in_loop(unsigned* bins, int n, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned v = i;
    for (int k = 0; k < iters; ++k) {
        v = v * 1664525u + 1013904223u;
        if ((v & 1023u) == 0u) atomicAdd(&bins[(v >> 10) & 63u], 1u);
    }
}
"""


def test_saved_aborts_run_every_atomic_exactly_once():
    """Atomics inside the loop: a restart would count twice and a rollback would redo;
    saved state continues each thread's loop, so the counts match an undisturbed run."""
    import cupy as cp

    from gpushare_ext.kernels.yield_flags import YieldFlag

    k = kernel(ATOMIC_LOOP, "count_in_loop")
    assert k.preemptible(abort_checks=True).saves_state
    n, iters = 1 << 16, np.int32(2_000_000)
    want = cp.zeros(64, dtype=cp.uint32)
    k.launch((n // 256,), (256,), (want, np.int32(n), iters), mode="off")
    cp.cuda.Device().synchronize()
    flag = YieldFlag()
    got = cp.zeros(64, dtype=cp.uint32)
    with _Toggler(flag, on_s=0.0005, period_s=0.002):
        rep = k.launch((n // 256,), (256,), (got, np.int32(n), iters), abort_checks=True,
                       yield_flag=flag)  # fmt: skip
    print(f"atomics under saved aborts: {rep}")
    assert rep.saves >= 1, rep
    _assert_stop_marks_in_order(rep)
    assert cp.asnumpy(got).tolist() == cp.asnumpy(want).tolist(), rep
    flag.close()


def test_a_kernel_from_a_whole_program_file_runs_preemptibly_and_exactly():
    """``kernel(Path)``: a template kernel of a file with host code, compiled by nvcc,
    launched by the transactional launcher, sliced by preemptions, equal to CuPy."""
    import cupy as cp

    from gpushare_ext.kernels import kernel, toolchain

    if toolchain.find_nvcc() is None or toolchain.find_host_compiler() is None:
        pytest.skip("needs nvcc (the toolchain extra) and a host C++ compiler")
    sources = Path(__file__).parent / "sources" / "app"
    k = kernel(sources / "templates.cu", "axpby<float>")
    n = 1 << 20
    rng = cp.random.default_rng(7)
    x = rng.standard_normal(n, dtype=cp.float32)
    y = rng.standard_normal(n, dtype=cp.float32)
    out = cp.zeros(n, dtype=cp.float32)

    k[(n + 255) // 256, 256](x, y, out, cp.float32(2), cp.float32(-1), cp.uint64(n))
    cp.cuda.Device().synchronize()

    assert cp.array_equal(out, cp.float32(2) * x + cp.float32(-1) * y)
    assert k.last_launch.mode in ("resume", "restart")

    inplace = kernel(sources / "namespaces.cu", "physics::solid::step")
    stress = rng.standard_normal(n, dtype=cp.float32)
    strain = rng.standard_normal(n, dtype=cp.float32)
    expected = stress + cp.float32(2) * strain  # a power of two: fused or not, one rounding
    inplace[(n + 255) // 256, 256](stress, strain, cp.float32(2), cp.int32(n))
    cp.cuda.Device().synchronize()
    assert cp.array_equal(stress, expected)
    assert inplace.last_launch.mode == "snapshot"
