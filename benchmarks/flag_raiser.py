"""Raise another process's yield flag on a timer, as the broker's actuator does: the
stop-latency benchmark's stand-in for the broker (``benchmarks/preemptible.py``).

It opens the flag through its CUDA IPC handle (creating this process's own context, as
the actuator does once per flag), says ``ready``, then raises the flag for ``ON_MS``
every ``PERIOD_MS`` -- ``cuStreamWriteValue32`` on a high-priority stream of its own --
until its standard input closes, and prints one JSON line: per raise, the moment it
began, the write queued and the write known to be in memory (``time.time_ns``) and the
beginning on ``time.perf_counter`` (both clocks are the host's, shared with the
benchmark).  In its own process the raise never waits for the benchmark's Python
thread, as the actuator's never waits for a notebook's.

``python -m benchmarks.flag_raiser HANDLE_HEX ON_MS PERIOD_MS``
"""

from __future__ import annotations

import json
import select
import sys
import time


def main(argv: list[str] | None = None) -> int:
    handle_hex, on_ms, period_ms = (argv or sys.argv[1:])[:3]
    from gpushare_ext.kernels.yield_flags import YieldFlag, open_yield_flag_from_handle

    address, _ = open_yield_flag_from_handle(bytes.fromhex(handle_hex))
    flag = YieldFlag(device_ptr=address)
    raised, raised_ns, queued_ns, written_ns = [], [], [], []
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], float(period_ms) / 1e3)[0]:
        raised.append(time.perf_counter())
        raised_ns.append(time.time_ns())
        flag.set(1, wait=False)
        queued_ns.append(time.time_ns())
        flag.wait_written()
        written_ns.append(time.time_ns())
        time.sleep(float(on_ms) / 1e3)
        flag.set(0)
    flag.set(0)
    print(json.dumps({"raised": raised, "raised_ns": raised_ns, "queued_ns": queued_ns,
                      "written_ns": written_ns}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
