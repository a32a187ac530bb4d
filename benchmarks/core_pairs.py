"""The scheduler core's cost per event in one checkout, as the minimum over repeats.

For comparing two checkouts of the code on a pinned core: run it once per checkout, the
two alternating, and compare the minimums (a shared machine's spread between runs is
larger than the differences looked for; the minimum is what the code costs when nothing
else interferes).  It measures with ``benchmarks.control_plane``'s core loop: every
lease running time-sliced (1,000 leases, 64 MiB each), and 1 GiB leases of which about
140 fit and the rest wait.

``taskset -c N python -m benchmarks.core_pairs [CHECKOUT]`` (default: this one)
"""

from __future__ import annotations

import sys
from pathlib import Path

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    checkout = Path(args[0]).resolve() if args else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(checkout))  # that checkout's gpushare_ext and benchmarks
    for name in [m for m in sys.modules if m.split(".")[0] in ("benchmarks", "gpushare_ext")]:
        del sys.modules[name]
    from benchmarks.control_plane import _core_run

    _core_run(1000, 64 * MIB, 300)  # warm-up
    sliced = [_core_run(1000, 64 * MIB, 2000)["us_per_event"] for _ in range(7)]
    bound = [_core_run(1000, 1024 * MIB, 1000)["us_per_event"] for _ in range(4)]
    print(
        f"{checkout}: µs per event, minimum of repeats: time-sliced {min(sliced)}, "
        f"memory-bound {min(bound)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
