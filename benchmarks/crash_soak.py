"""Crash soak: ``kill -9`` the broker over and over while notebooks keep asking for leases.

Starts ``gpushare broker --simulate h200`` and a few client processes, each a real
:class:`~gpushare_ext.runtime.session.GpuSession` (the runtime notebooks use, with its
reconnect and reclaim) looping: ask for a lease (a random priority band and 4-60 GiB,
so requests queue and preempt each other), hold it for a moment calling
``safe_point()``, release it.  Meanwhile the broker is killed with SIGKILL at random
moments and started again on the same socket and journal, ``--kills`` times.

Counted, per client and in total:

* requests made, granted, refused (policy says why: a typed answer), left unanswered
  (no grant, refusal or clear error within ``--answer-timeout`` s);
* live leases lost: a lease a cell held that the runtime reported revoked;
* the longest time a ``safe_point()`` was held, and whether any session was still held
  (paused with nobody above it) at the end;
* broker exits that were not our kills, tracebacks in its log, and the actuator steps
  the journal still lists as applied after the final clean stop.

Usage::

    python -m benchmarks.crash_soak --kills 100 --clients 6 --out benchmarks/results/<date>-cpu

writes ``crash_soak.json`` and prints a table; exits 1 if any count that must be 0 is not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import sqlite3
import tempfile
import time
from pathlib import Path

from benchmarks.environment import describe
from benchmarks.stopping import exit_on_signals, track

CONFIG = """
[broker]
reclaim_grace_s = 60
max_requests_per_second = 100000
[defaults]
max_leases = 64
aging_per_minute = 120
"""
GIB = 1024**3
MUST_BE_ZERO = (
    "unanswered_requests", "client_errors", "live_leases_lost", "sessions_held_at_end",
    "clients_that_did_not_finish", "broker_exits_not_ours", "pending_actuations_after_stop",
    "tracebacks_in_log",
)  # fmt: skip
PRIORITIES = ["low", "normal", "high"]


def client_main(
    socket_path: str, seed: int, stop_file: str, results: str, timeout_s: float
) -> None:
    """One notebook's worth of traffic through the real runtime session."""
    from gpushare_ext.client import BrokerError
    from gpushare_ext.protocol import priority_value
    from gpushare_ext.runtime.session import GpuSession, LeaseRefused, LeaseTimeout

    rng = random.Random(seed)
    session = GpuSession(socket_path, notebook=f"soak-{seed}.ipynb")
    counts = {
        "requests": 0,
        "granted": 0,
        "refused": 0,
        "unanswered": 0,
        "errors": 0,
        "leases_lost": 0,
        "paused": 0,
        "reclaimed": 0,
        "longest_hold_s": 0.0,
    }
    samples: list[str] = []
    while not os.path.exists(stop_file):
        priority = rng.choice(PRIORITIES)
        options = session.merged(
            priority=priority_value(priority),
            memory_bytes=rng.choice([4, 16, 40, 60]) * GIB,
            timeout_s=timeout_s,
        )
        counts["requests"] += 1
        try:
            handle = session.acquire(options, label=f"soak {priority}")
        except LeaseTimeout as exc:
            counts["unanswered"] += 1
            samples.append(f"{priority} {options.memory_bytes // GIB} GiB: {exc}")
            continue
        except LeaseRefused as exc:
            if "revoked" in str(exc) or "did not keep" in str(exc):
                counts["leases_lost"] += 1
                samples.append(str(exc))
            else:
                counts["refused"] += 1
            continue
        except BrokerError as exc:
            counts["errors"] += 1
            samples.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.2)
            continue
        counts["granted"] += 1
        until = time.monotonic() + rng.uniform(0.05, 0.6)
        while time.monotonic() < until:
            held_from = time.monotonic()
            session.safe_point()
            counts["longest_hold_s"] = max(counts["longest_hold_s"], time.monotonic() - held_from)
            time.sleep(0.01)
        if handle.state == "revoked":
            counts["leases_lost"] += 1
            samples.append(handle.revoked)
        what = [text for _, text in handle.events]
        counts["paused"] += any(text.startswith("paused") for text in what)
        counts["reclaimed"] += any(text.startswith("reclaimed") for text in what)
        with contextlib.suppress(BrokerError):
            session.release(handle)
        time.sleep(rng.uniform(0.0, 0.2))
    block = session.control_block
    counts["held_at_end"] = bool(block is not None and (block.paused or block.gate_closed))
    session.close()
    counts["samples"] = samples[:5]
    Path(results).write_text(json.dumps(counts))


def _pending_actuations(journal: Path) -> int:
    db = sqlite3.connect(journal)
    try:
        return int(
            db.execute("SELECT COUNT(*) FROM actuations WHERE undone_at IS NULL").fetchone()[0]
        )
    finally:
        db.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=20261201)
    # Long enough for any request to age past every band (120 points a minute): a
    # request still without an answer then was lost, not merely outranked.
    parser.add_argument("--answer-timeout", type=float, default=240.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="5 kills (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.kills = 5
    exit_on_signals()  # ended by a signal (or an error), it still stops the broker and clients

    from gpushare_ext.broker.launch import BrokerProcess
    from gpushare_ext.client import BrokerClient, BrokerError

    rng = random.Random(args.seed)
    directory = Path(tempfile.mkdtemp(prefix="gps-soak-", dir="/tmp"))
    broker = track(BrokerProcess(directory, config_toml=CONFIG, log_level="info")).start()
    stop_file = directory / "stop"
    context = multiprocessing.get_context("fork")
    workers = []
    for index in range(args.clients):
        out = directory / f"client-{index}.json"
        process = context.Process(
            target=client_main,
            args=(
                str(broker.socket),
                args.seed + index,
                str(stop_file),
                str(out),
                args.answer_timeout,
            ),
        )
        track(process).start()
        workers.append((process, out))
    started = time.monotonic()
    unexpected_exits = []
    restart_s = []
    leases_at_kill = []
    for _ in range(args.kills):
        time.sleep(rng.uniform(0.3, 2.5))
        if not broker.alive():
            unexpected_exits.append(broker.process.returncode if broker.process else None)
        with (
            contextlib.suppress(BrokerError),
            BrokerClient(broker.socket, client="bench", connect_timeout=2) as probe,
        ):
            leases_at_kill.append(len(probe.status().leases))
        code = broker.stop(signal.SIGKILL)
        if code != -signal.SIGKILL:
            unexpected_exits.append(code)
        began = time.monotonic()
        broker.start()
        restart_s.append(time.monotonic() - began)
    # Let the last restart settle, then let every client finish its current lease.
    time.sleep(5)
    stop_file.touch()
    for process, _ in workers:
        process.join(timeout=args.answer_timeout + 60)
        if process.is_alive():
            process.kill()
    took = time.monotonic() - started
    alive = broker.alive()
    final_status = broker.stop(signal.SIGTERM)
    log = broker.output()
    pending = _pending_actuations(broker.journal_path)
    clients = []
    for _, out in workers:
        try:
            clients.append(json.loads(out.read_text()))
        except (OSError, ValueError):
            clients.append({"missing": True})

    def total(key: str) -> int:
        return int(sum(c.get(key, 0) for c in clients))

    summary = {
        "broker_kills": args.kills,
        "requests": total("requests"),
        "granted": total("granted"),
        "refused_with_reason": total("refused"),
        "unanswered_requests": total("unanswered"),
        "client_errors": total("errors"),
        "live_leases_lost": total("leases_lost"),
        "leases_paused_by_preemption": total("paused"),
        "leases_reclaimed_after_a_kill": total("reclaimed"),
        "sessions_held_at_end": sum(bool(c.get("held_at_end")) for c in clients),
        "clients_that_did_not_finish": sum(bool(c.get("missing")) for c in clients),
        "longest_safe_point_hold_s": round(max(c.get("longest_hold_s", 0) for c in clients), 2),
        "broker_exits_not_ours": len(unexpected_exits),
        "broker_alive_before_final_stop": alive,
        "final_sigterm_exit_status": final_status,
        "pending_actuations_after_stop": pending,
        "tracebacks_in_log": log.count("Traceback"),
        "restart_s_median": round(sorted(restart_s)[len(restart_s) // 2], 2) if restart_s else None,
        "leases_open_at_a_kill_max": max(leases_at_kill, default=0),
        "seconds": round(took, 1),
    }
    record = {
        **describe(),
        "clients": args.clients,
        "seed": args.seed,
        "summary": summary,
        "per_client": clients,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "crash_soak.json").write_text(json.dumps(record, indent=2) + "\n")
    failed = any(summary[key] for key in MUST_BE_ZERO) or not alive
    if failed:
        print(f"kept the broker's log and journal for a look: {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{'measure':34} value")
    for key, value in summary.items():
        print(f"{key:34} {value}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
