"""What the host link gives: device-to-host and host-to-device copies into pinned memory.

The limit a park (device memory copied out to pinned host memory) and a restore can
reach: one direction at a time and both at once, over 1, 2 and 4 streams, in chunks of
``--chunk-mib``.  Each figure is the best of ``--repeats`` timed passes (after one
untimed pass), timed with CUDA events around the whole pass.  Needs CuPy and a GPU.

    python -m benchmarks.host_link --gib 4 --out results/host-link

It must not be imported by the package: it is evidence, not code the broker runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.environment import describe

GIB = 1024**3


def _pass(cupy, device, host, streams, chunk: int, directions: tuple[str, ...]) -> float:
    """One timed pass moving every chunk of ``device``/``host`` in each of ``directions``
    (round-robin over ``streams``); returns the GiB/s of all bytes moved."""
    runtime = cupy.cuda.runtime
    kinds = {"d2h": runtime.memcpyDeviceToHost, "h2d": runtime.memcpyHostToDevice}
    size = device.nbytes
    half = size // 2 if len(directions) == 2 else size
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.Device().synchronize()
    start.record(cupy.cuda.Stream.null)
    moved = 0
    count = 0
    for index, direction in enumerate(directions):
        base = index * half if len(directions) == 2 else 0
        for offset in range(0, half, chunk):
            length = min(chunk, half - offset)
            device_at = device.data.ptr + base + offset
            host_at = host.ptr + base + offset
            dst, src = (host_at, device_at) if direction == "d2h" else (device_at, host_at)
            stream = streams[count % len(streams)]
            runtime.memcpyAsync(dst, src, length, kinds[direction], stream.ptr)
            moved += length
            count += 1
    for stream in streams:
        stream.synchronize()
    end.record(cupy.cuda.Stream.null)
    end.synchronize()
    seconds = cupy.cuda.get_elapsed_time(start, end) / 1000.0
    return moved / GIB / seconds


def measure(gib: float, chunk_mib: int, repeats: int) -> list[dict]:
    import cupy

    size = int(gib * GIB)
    device = cupy.empty(size, dtype=cupy.uint8)
    device.fill(7)
    host = cupy.cuda.alloc_pinned_memory(size)
    chunk = chunk_mib * 1024 * 1024
    rows = []
    for directions in (("d2h",), ("h2d",), ("d2h", "h2d")):
        for count in (1, 2, 4):
            streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(count)]
            _pass(cupy, device, host, streams, chunk, directions)  # untimed: warms the path
            best = max(
                _pass(cupy, device, host, streams, chunk, directions) for _ in range(repeats)
            )
            rows.append(
                {
                    "direction": "+".join(directions),
                    "streams": count,
                    "gib_per_s": round(best, 2),
                }
            )
            print(f"{'+'.join(directions):8} {count} stream(s)  {best:6.2f} GiB/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="bytes moved per pass (GiB)")
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        rows = measure(args.gib, args.chunk_mib, args.repeats)
    except ImportError as exc:
        print(f"host_link: needs CuPy and a GPU ({exc})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        **describe(),
        "benchmark": "host_link",
        "gib": args.gib,
        "chunk_mib": args.chunk_mib,
        "repeats": args.repeats,
        "rows": rows,
    }
    (args.out / "host_link.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
