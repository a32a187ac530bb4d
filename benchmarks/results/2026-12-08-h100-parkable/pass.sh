source benchmarks/device_setup.sh .whl > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 1; }
head -1 $OUT/setup.log
timeout 100 python3 -m pytest -p no:cacheprovider -q -rA -s tests/runtime/test_parkable_memory_gpu.py > $OUT/parkable.log 2>&1; echo parkable rc=$?
grep -E '"(parked_gib|freed_gib|park_gib_s|explicit_restore_gib_s|identical|model_output_identical|same_addresses|why_short|torch|cupy|numba)"|Error|assert' $OUT/parkable.log | head -24
timeout 70 python3 -m benchmarks.vmm_park --gib 12 --allocations 12 --repeats 1 --out $OUT/vmm > $OUT/vmm.log 2>&1; echo vmm rc=$?; cut -c1-300 $OUT/vmm.log | tail -7
timeout 30 python3 -m benchmarks.host_link --gib 4 --repeats 2 --out $OUT/link > $OUT/link.log 2>&1; echo link rc=$?; tail -9 $OUT/link.log
timeout ${GPU_S:-280} python3 -m pytest -p no:cacheprovider -v -m gpu tests/runtime/test_first_cell_gpu.py tests/broker tests/kernels/test_interrupt_gpu.py tests/runtime/test_interposer_gpu.py tests/runtime/test_runtime_gpu.py tests/kernels > $OUT/gpu.log 2>&1; echo gpu rc=$?
grep -cE " PASSED" $OUT/gpu.log; grep -E " (FAILED|ERROR|XPASS|XFAIL)|passed|failed" $OUT/gpu.log | cut -c1-220 | tail -14
