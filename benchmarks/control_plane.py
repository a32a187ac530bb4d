"""Control-plane benchmark: how fast the broker answers lease requests, 1 to 256 clients.

Starts a real broker (``gpushare broker --simulate h200``) on a temporary socket, then
for each client count runs that many clients at once, each with its own
:class:`~gpushare_ext.client.BrokerClient` connection.  Every client repeats a
*cycle*: request a lease (normal priority, 64 MiB, so all leases time-slice the one
GPU and are granted at once) and release it.  Clients are threads spread over a few
forked worker processes, so the client side is not one GIL.

Measured per client count:

* request -> grant round trip (p50/p90/p99/max, ms): from sending ``request_lease`` to
  receiving its ``granted`` reply;
* the whole cycle (request + grant + release + released);
* messages/s: client messages answered per second (each cycle is two requests and two
  replies), and cycles/s.

The broker's config lifts the per-uid connection, rate and lease limits so that the
limits do not shape the result.  Usage::

    python -m benchmarks.control_plane --clients 1,16,64,256 --requests 200 --out DIR

writes ``DIR/control_plane.json`` (host, CPU count, date, command, Python version and
the results) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.environment import describe
from gpushare_ext.broker.launch import BrokerProcess

MIB = 1024 * 1024
CONFIG = """
[broker]
max_connections_per_uid = 100000
max_requests_per_second = 1000000

[defaults]
max_leases = 10000
"""


# ------------------------------------------------------------------ the broker


# ------------------------------------------------------------------ the clients


def _client_thread(sock: Path, requests: int, ready, go, out: list, errors: list) -> None:
    from gpushare_ext.client import BrokerClient
    from gpushare_ext.protocol import Granted

    try:
        client = BrokerClient(sock, client="bench", connect_timeout=30)
    except Exception as exc:  # a client that cannot connect is a result, not a crash
        errors.append(f"connect: {exc}")
        ready()
        return
    ready()
    go.wait()
    grants, cycles = [], []
    try:
        for _ in range(requests):
            started = time.perf_counter()
            reply = client.request_lease(priority=150, memory_bytes=64 * MIB, label="bench")
            granted = time.perf_counter()
            if not isinstance(reply, Granted):
                errors.append(f"not granted at once: {type(reply).__name__}")
                continue
            client.release(reply.lease_id)
            done = time.perf_counter()
            grants.append(granted - started)
            cycles.append(done - started)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    out.append((grants, cycles))


def _worker(sock: Path, clients: int, requests: int, ready_count, go, results) -> None:
    out: list = []
    errors: list = []
    lock = threading.Lock()

    def ready() -> None:
        with lock, ready_count.get_lock():
            ready_count.value += 1

    threads = [
        threading.Thread(
            target=_client_thread, args=(sock, requests, ready, go, out, errors), daemon=True
        )
        for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    grants = [x for g, _ in out for x in g]
    cycles = [x for _, c in out for x in c]
    results.put((grants, cycles, errors))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def measure(sock: Path, clients: int, requests: int, workers: int) -> dict:
    context = multiprocessing.get_context("fork")
    workers = max(1, min(workers, clients))
    shares = [clients // workers + (1 if i < clients % workers else 0) for i in range(workers)]
    ready_count = context.Value("i", 0)
    go = context.Event()
    results = context.Queue()
    processes = [
        context.Process(target=_worker, args=(sock, share, requests, ready_count, go, results))
        for share in shares
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 120
    while ready_count.value < clients and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    go.set()
    grants: list[float] = []
    cycles: list[float] = []
    errors: list[str] = []
    for _ in processes:
        g, c, e = results.get(timeout=1800)
        grants += g
        cycles += c
        errors += e
    wall = time.perf_counter() - started
    for process in processes:
        process.join(timeout=30)
    ms = 1000.0
    return {
        "clients": clients,
        "worker_processes": workers,
        "requests_per_client": requests,
        "cycles": len(cycles),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "wall_s": round(wall, 3),
        "grant_ms": {
            "p50": round(_percentile(grants, 50) * ms, 3),
            "p90": round(_percentile(grants, 90) * ms, 3),
            "p99": round(_percentile(grants, 99) * ms, 3),
            "max": round(max(grants, default=float("nan")) * ms, 3),
            "mean": round(statistics.fmean(grants) * ms, 3) if grants else None,
        },
        "cycle_ms": {
            "p50": round(_percentile(cycles, 50) * ms, 3),
            "p99": round(_percentile(cycles, 99) * ms, 3),
        },
        "cycles_per_s": round(len(cycles) / wall, 1),
        "messages_per_s": round(2 * len(cycles) / wall, 1),
    }


# ------------------------------------------------------------------ the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.control_plane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--clients", default="1,16,64", help="comma list of client counts (default 1,16,64)"
    )
    parser.add_argument(
        "--requests", type=int, default=200, help="request+release cycles per client"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=max(2, min(8, os.cpu_count() or 2)),
        help="client worker processes (clients are threads spread over them)",
    )
    parser.add_argument("--out", required=True, help="folder for control_plane.json")
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--clients must be a comma list of numbers, not {args.clients!r}")
    if not counts or min(counts) < 1 or args.requests < 1:
        parser.error("client counts and --requests must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    load_before = os.getloadavg()
    directory = Path(tempfile.mkdtemp(prefix="gps-bench-", dir="/tmp"))
    broker = BrokerProcess(directory, config_toml=CONFIG, log_level="warning").start()
    results = []
    try:
        for clients in counts:
            print(f"{clients} client(s) x {args.requests} cycles ...", flush=True)
            results.append(measure(broker.socket, clients, args.requests, args.workers))
    finally:
        broker.stop(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)

    document = {
        **describe(),
        "benchmark": "control_plane",
        "broker": "gpushare broker --simulate h200 (user mode, SQLite journal, one process)",
        "what": "lease request->grant round trip and messages/s; normal priority, 64 MiB, "
        "all granted at once (time-sliced); each client its own connection",
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "results": results,
    }
    (out / "control_plane.json").write_text(json.dumps(document, indent=2) + "\n")
    print()
    print(
        f"{'clients':>7} {'cycles':>7} {'grant p50':>10} {'p90':>8} {'p99':>8} {'max':>8} "
        f"{'msgs/s':>8} {'errors':>6}"
    )
    for r in results:
        g = r["grant_ms"]
        print(
            f"{r['clients']:>7} {r['cycles']:>7} {g['p50']:>8.2f}ms {g['p90']:>6.2f}ms "
            f"{g['p99']:>6.2f}ms {g['max']:>6.1f}ms {r['messages_per_s']:>8.0f} {r['errors']:>6}"
        )
    print(f"\nwrote {out / 'control_plane.json'}")
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
