#!/usr/bin/env bash
# The GPU pass for "the first cell is never slow", run on the lent GPU machine:
#
#   bash benchmarks/first_cell_pass.sh STAGE [WHEELS]      (logs and JSON under $OUT)
#   (env: TESTS_S, TP_S, LOWS, MODES, COST_S, COST_REPEATS, STOPS, STOP_S, KINDS, PROBE_S)
#
# STAGE tests: the GPU tests of a kernel launched before the high session existed, the
#   unmarked Ctrl-C loop and the demo;  third_party: one interactive-latency run beside
#   the long neighbours and the library kernels (cuFFT, short cuBLAS GEMMs);  cost: the
#   long kernel's cost with nobody waiting, and stop latency per framework;  probe: what
#   the neighbours of KINDS (default: every one) got when the high session came.
set -o pipefail
stage=$1
out=${OUT:-/tmp/out}
mkdir -p "$out"
source benchmarks/device_setup.sh "${2:-.whl}" >"$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
head -1 "$out/setup.log"
shim=$PWD/gpushare_ext/runtime/native/libgpushare_interpose.so
case $stage in
tests)
  timeout "${TESTS_S:-420}" python3 -m pytest -p no:cacheprovider -q -rA -s \
    tests/runtime/test_first_cell_gpu.py \
    tests/kernels/test_interrupt_gpu.py::test_ctrl_c_in_an_unmarked_loop_of_long_kernels_leaves_no_queue_behind \
    tests/broker/hands/test_ladder_gpu.py::test_demo_runs_on_the_real_gpu_and_the_preempted_result_is_identical \
    >"$out/gpu_tests.log" 2>&1
  echo "pytest rc=$?"
  grep -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)|passed|failed" "$out/gpu_tests.log" | tail -15
  ;;
third_party)
  timeout "${TP_S:-560}" python3 -m benchmarks.third_party --notebook --modes "${MODES:-timeslice,shim}" \
    --lows "${LOWS:-numba_inplace,cupy_elementwise,short_gemm,cupy_fft}" --out "$out/tp" \
    >"$out/third_party.log" 2>&1
  echo "third_party rc=$?"
  tail -14 "$out/third_party.log"
  ;;
cost)
  timeout "${COST_S:-240}" python3 -m benchmarks.long_kernel_cost --out "$out/cost" --ways plain,alone \
    --repeats "${COST_REPEATS:-1}" --launches 6 >"$out/cost.log" 2>&1
  echo "long_kernel_cost rc=$?"; tail -12 "$out/cost.log"
  for only in ${STOPS:-gps_long_ew:300 gps_numba_relax:50}; do
    LD_PRELOAD=$shim CUPY_COMPILE_WITH_PTX=1 timeout "${STOP_S:-150}" python3 -m benchmarks.preemptible \
      --only "${only%%:*}" --launches "${only##*:}" --on-ms 0.3 --period-ms 1 --out "$out/stops-${only%%:*}" \
      >"$out/stops-${only%%:*}.log" 2>&1
    echo "preemptible ${only%%:*} rc=$?"; grep -v '^{' "$out/stops-${only%%:*}.log" | tail -8
  done
  ;;
probe)
  timeout "${PROBE_S:-400}" python3 -m benchmarks.first_cell_probe \
    "${KINDS:-numba_inplace,numba_linked,cupy_elementwise,cupy_reduction,cupy_rawmodule,cupyx_jit,driver_ptx}"
  ;;
*) echo "stage: tests, third_party, cost or probe" >&2; exit 2 ;;
esac
