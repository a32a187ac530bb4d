"""Parking on a real GPU: idle notebooks checkpointed for a high-priority request, then
restored by their next plain cell with their arrays bit-identical.

What it does, all through the real pieces (a ``gpushare broker`` on NVML, ipykernel
kernels with ``%load_ext gpushare_ext``):

1. ``--notebooks`` kernels each run one ``%%gpu`` cell (so the broker knows them) and
   then, in a plain cell, fill ``--idle-gib`` GiB of CuPy arrays and keep them: idle
   notebooks holding memory outside any lease.
2. This process asks for a high-priority lease of ``--ask-gib`` GiB, which fits only if
   the idle notebooks are parked; the time to the grant is the park time.  It then
   allocates what it was granted (no out-of-memory error) and releases it.
3. Each notebook runs a plain cell that fingerprints its arrays on the GPU (XOR and sum
   of their 64-bit words); its first line restores it, and the restore line says how
   long that took.

Writes ``parking.json`` under ``--out``::

    python -m benchmarks.parking --notebooks 2 --idle-gib 30 --ask-gib 115 --out DIR

Needs a GPU with MIG off, CuPy and jupyter_client; it refuses to start otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.environment import describe
from benchmarks.stopping import exit_on_signals, track

FILL = """
import cupy
_words = ({gib} << 30) // 8
_gen = cupy.random.default_rng(1234)
arrays = [_gen.integers(0, 2**63 - 1, size=_words // 4, dtype=cupy.int64) for _ in range(4)]
cupy.cuda.runtime.deviceSynchronize()
_xor = cupy.ReductionKernel("uint64 x", "uint64 y", "x", "a ^ b", "y = a", "0", "gps_xor")
def fingerprint():
    x = 0
    s = 0
    for a in arrays:
        words = a.view(cupy.uint64)
        x ^= int(_xor(words))
        s = (s + int(words.sum(dtype=cupy.uint64))) % 2**64
    return f"{{x:x}}-{{s:x}}"
print("FINGERPRINT", fingerprint())
"""
CHECK = 'print("FINGERPRINT", fingerprint())'
STEP_TIMEOUT_S = 150.0  # one cell, or the park, may take this long before it is a failure
_STARTED = time.monotonic()


def _say(what: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {what}", flush=True)


RESTORED = re.compile(r"restored ([\d.]+ \w+) parked .* in ([\d.]+) s")


@dataclass
class Notebook:
    """A real kernel, with every text its cells showed (live lines included)."""

    name: str
    env: dict
    shown: list[str] = field(default_factory=list)

    def start(self) -> Notebook:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", env=self.env)
        return self

    def run(self, code: str, timeout: float = STEP_TIMEOUT_S) -> str:
        printed: list[str] = []

        def collect(message: dict) -> None:
            content = message["content"]
            if message["msg_type"] == "stream":
                printed.append(content["text"])
            elif message["msg_type"] in ("display_data", "update_display_data"):
                self.shown.append(content["data"].get("text/plain", ""))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=collect)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(
                f"{self.name}: cell failed: {reply['content'].get('ename')}: "
                f"{reply['content'].get('evalue')}"
            )
        return "".join(printed)

    def fingerprint(self, code: str) -> str:
        line = next(x for x in self.run(code).splitlines() if x.startswith("FINGERPRINT "))
        return line.split(" ", 1)[1]

    def stop(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def _fill(kernels: list[Notebook], idle_gib: int) -> list[str]:
    """Each kernel runs a ``%%gpu`` cell, then fills ``idle_gib`` GiB outside any lease;
    their fingerprints."""
    before = []
    for kernel in kernels:
        kernel.run("%load_ext gpushare_ext")
        kernel.run("%%gpu mem=1GiB\nprint('a cell under a lease')")
        before.append(kernel.fingerprint(FILL.format(gib=idle_gib)))
        _say(f"{kernel.name} holds {idle_gib} GiB, fingerprint {before[-1]}")
    return before


def _wait_until_seen(socket: Path, held_mib: int) -> None:
    """Until the broker's NVML reading shows ``held_mib`` outside leases (20 s at most)."""
    from gpushare_ext.client import BrokerClient

    with BrokerClient(socket, client="cli") as looker:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the broker's NVML reading of them
            held = sum(sum(d.memory_outside_leases_mib.values()) for d in looker.status().devices)
            if held >= held_mib:
                break
            time.sleep(0.2)


def _park_for(socket: Path, ask_gib: int, result: dict) -> None:
    """Ask for the high lease, time it to the grant (the park), allocate what it granted
    and release it; the figures go into ``result``."""
    import cupy

    from gpushare_ext.client import BrokerClient
    from gpushare_ext.protocol import Granted, Queued

    granted = threading.Event()
    asked = time.monotonic()
    with BrokerClient(
        socket,
        client="bench",
        listener=lambda m: granted.set() if isinstance(m, Granted) else None,
    ) as asker:
        reply = asker.request_lease(priority=250, memory_bytes=ask_gib << 30, device="0")
        queued_reason = reply.reason if isinstance(reply, Queued) else ""
        if isinstance(reply, Granted):
            granted.set()
        _say(f"asked for {ask_gib} GiB: {type(reply).__name__} {queued_reason}")
        if not granted.wait(STEP_TIMEOUT_S):
            raise RuntimeError(f"no grant within {STEP_TIMEOUT_S:g} s")
        result["park_s"] = time.monotonic() - asked
        _say(f"granted after {result['park_s']:.1f} s")
        result["queued_reason"] = queued_reason
        parks = [lease for lease in asker.status().leases if lease.label == "parked idle session"]
        result["parked"] = [
            {"pid": lease.pid, "state": str(lease.state), "gib": lease.memory_bytes / (1 << 30)}
            for lease in parks
        ]
        # Take what was granted, less this process's own CUDA context.
        block = cupy.empty(((ask_gib - 2) << 30) // 8, dtype=cupy.int64)
        block.fill(7)
        cupy.cuda.runtime.deviceSynchronize()
        result["granted_allocation_gib"] = ask_gib - 2
        del block
        cupy.get_default_memory_pool().free_all_blocks()
        asker.release(reply.lease_id)
        _say(f"allocated {ask_gib - 2} GiB and released; parks: {result['parked']}")


def _stop_notes(socket: Path) -> list[str]:
    """Why each parked session is stopped and what stopped it, as status tells it (the
    session's own park of its parkable memory names its size and rate)."""
    from gpushare_ext.client import BrokerClient

    with BrokerClient(socket, client="cli") as looker:
        leases = looker.status().leases
        return [lease.reason for lease in leases if lease.label == "parked idle session"]


def _restores(kernels: list[Notebook], before: list[str]) -> list[dict]:
    """Each kernel's next plain cell (which restores it): its arrays against their
    fingerprint, and what its restore line said."""
    restores = []
    for kernel, fingerprint in zip(kernels, before, strict=True):
        started = time.monotonic()
        after = kernel.fingerprint(CHECK)
        lines = [RESTORED.search(text) for text in kernel.shown]
        found = [m for m in lines if m]
        _say(f"{kernel.name}: {kernel.shown[-1] if kernel.shown else 'no line'}")
        restores.append(
            {
                "bit_identical": after == fingerprint,
                "cell_s": time.monotonic() - started,
                "restore_line_s": float(found[-1].group(2)) if found else None,
                "restored": found[-1].group(1) if found else None,
            }
        )
    return restores


def _add_rates(result: dict) -> None:
    """GiB parked, and the park's and the restores' GiB/s, into ``result``."""
    restores = result["restores"]
    parked_gib = sum(p["gib"] for p in result["parked"])
    result["parked_gib"] = parked_gib
    result["park_gib_per_s"] = parked_gib / result["park_s"] if result["park_s"] else None
    restored_s = [r["restore_line_s"] for r in restores if r["restore_line_s"]]
    result["restore_gib_per_s"] = (
        (parked_gib / len(result["parked"])) / (sum(restored_s) / len(restored_s))
        if restored_s and result["parked"]
        else None
    )


def measure(
    notebooks: int, idle_gib: int, ask_gib: int, log_dir: Path, parkable: bool = False
) -> dict:
    import cupy  # noqa: F401 - first, so that a missing CuPy fails before a broker starts

    from gpushare_ext.broker.edges.launch import BrokerProcess
    from gpushare_ext.runtime.interpose import shim_path

    broker = track(BrokerProcess(Path(tempfile.mkdtemp(prefix="gps-park-")), simulate=None))
    broker.start(timeout=60)
    # As the server extension starts kernels: with the launch shim preloaded, which also
    # tells the broker whether the process may be checkpointed.
    env = dict(os.environ, GPUSHARE_SOCKET=str(broker.socket), LD_PRELOAD=str(shim_path()))
    if parkable:  # their shim backs large allocations so that it can park them itself
        env["GPUSHARE_PARKABLE_MEMORY"] = "1"
    kernels: list[Notebook] = []
    result: dict = {
        "notebooks": notebooks, "idle_gib": idle_gib, "ask_gib": ask_gib, "parkable": parkable,
    }  # fmt: skip
    try:
        kernels += [Notebook(f"notebook-{i}", env).start() for i in range(notebooks)]
        before = _fill(kernels, idle_gib)
        _wait_until_seen(broker.socket, notebooks * idle_gib * 1024)
        _park_for(broker.socket, ask_gib, result)
        result["stop_notes"] = _stop_notes(broker.socket)
        result["restores"] = _restores(kernels, before)
        _add_rates(result)
    finally:
        (log_dir / "parking-broker.log").write_text(broker.output())
        shown = [f"{kernel.name}: {text}" for kernel in kernels for text in kernel.shown]
        (log_dir / "parking-cells.log").write_text("\n".join(shown) + "\n")
        for kernel in kernels:
            kernel.stop()
        broker.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", type=int, default=2)
    parser.add_argument("--idle-gib", type=int, default=30)
    parser.add_argument("--ask-gib", type=int, default=115)
    parser.add_argument(
        "--parkable",
        action="store_true",
        help="start the notebooks with parkable memory (the shim parks it itself)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    exit_on_signals()  # ended by a signal, it still stops the broker and the kernels
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.notebooks, args.idle_gib, args.ask_gib, out, args.parkable)
    document = {
        **describe(),
        "benchmark": "parking",
        "results": result,
    }
    (out / "parking.json").write_text(json.dumps(document, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
