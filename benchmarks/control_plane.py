"""Control-plane benchmark: how fast the broker answers lease requests as the host gets busy.

Three parts, each optional:

* **closed loop** (``--clients 1,64,256,1024``): a real broker (``gpushare broker
  --simulate h200``) on a temporary socket; for each client count that many clients at
  once, each with its own :class:`~gpushare_ext.client.BrokerClient` connection, each
  repeating a *cycle*: request a lease (normal priority, 64 MiB, so all leases
  time-slice the one GPU and are granted at once) and release it, as fast as answers
  come.  Clients are threads spread over a few forked worker processes, so the client
  side is not one GIL.  A connect that finds the broker's listen backlog full
  (``EAGAIN``, when a thousand clients connect at the same moment) is tried again and
  counted; the measurement starts once every client is connected.
* **open loop** (``--open-loop 1000``): that many sessions, each its own connection,
  each requesting a lease once a second (``--rate``) at its own phase of the second,
  whatever the broker's answers, holding it ``--hold`` seconds and releasing it, for
  ``--duration`` seconds: about ``sessions x hold`` leases are live at any moment.  The
  sessions of a worker process share one asyncio loop (a thread each would add the
  load generator's own scheduling to the latency).  The request -> grant round trip is
  measured from the send; how late a session sent after its due time is reported too,
  so a client side that could not keep up shows.
* **core** (``--core-leases 1,64,256,1000``): the scheduler core alone, in this
  process, with that many leases: µs per event for a release, a request and a tick,
  with every lease running (time-sliced on one GPU) and with 1 GiB leases, where ~140
  run and the rest wait (each release lets the first waiter in and moves every waiter
  behind it up one; the first ten and those whose place, rounded up past 10, changes
  are told: the notices per event are reported too).
* **core, waiting** (``--core-waiters 1,64,256,1000``): the core alone on two simulated
  H200s, with that many requests waiting for GPU 0 (which one high lease fills) while
  GPU 1 serves 64 small time-sliced leases.  A cycle is five events that leave the
  waiters' places alone: a lease on GPU 1 released and asked for again, a request
  joining the back of the queue and withdrawn, a tick.  ``--core-repeats`` runs every
  core row that many times; the row gives the median and each run's figure.

The core runs first; the closed loop and the open loop each get a fresh broker.

Measured per closed-loop client count: request -> grant round trip (p50/p90/p99/max,
ms), the whole cycle, messages/s (client messages answered per second; each cycle is
two requests and two replies) and cycles/s.

The broker's config lifts the per-uid connection, rate and lease limits so that the
limits do not shape the result.  Usage::

    python -m benchmarks.control_plane --clients 1,64,256,1024 --open-loop 1000 \\
        --core-leases 1,64,256,1000 --out DIR

writes ``DIR/control_plane.json`` (host, CPU count, date, command, Python version and
the results) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.environment import describe
from benchmarks.stopping import exit_on_signals, stop, track
from gpushare_ext.broker.edges.launch import BrokerProcess

MIB = 1024 * 1024
GIB = 1024 * MIB
CONFIG = """
[broker]
max_connections_per_uid = 100000
max_requests_per_second = 1000000

[defaults]
max_leases = 10000
"""
CORE_TARGET_US = 50.0  # per event at 1,000 leases
OPEN_LOOP_TARGET_P99_MS = 2.0
CONNECT_RETRIES = 200


# ------------------------------------------------------------------ the clients


def _connect(sock: Path, retried: list):
    """A client, trying again while the broker's listen backlog is full."""
    from gpushare_ext.client import BrokerClient, BrokerUnavailable

    for attempt in range(CONNECT_RETRIES):
        try:
            return BrokerClient(sock, client="bench", connect_timeout=30)
        except BrokerUnavailable as exc:
            if f"[Errno {errno.EAGAIN}]" not in str(exc) or attempt == CONNECT_RETRIES - 1:
                raise
            retried.append(1)
            time.sleep(0.005 * (1 + attempt % 20))
    raise AssertionError("unreachable")


def _client_thread(sock: Path, requests: int, ready, go, out: list, errors: list) -> None:
    from gpushare_ext.protocol import Granted

    retried: list = []
    try:
        client = _connect(sock, retried)
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
    out.append((grants, cycles, len(retried)))


async def _open_session(sock: Path, retried: list):
    """An asyncio connection that said hello, trying again while the backlog is full."""
    import asyncio
    import socket

    from gpushare_ext.protocol import PROTOCOL_VERSION, Hello

    for attempt in range(CONNECT_RETRIES):
        # A blocking connect: asyncio's would take EAGAIN (backlog full) for "in progress".
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.connect(str(sock))
            break
        except BlockingIOError:
            raw.close()
            if attempt == CONNECT_RETRIES - 1:
                raise
            retried.append(1)
            await asyncio.sleep(0.005 * (1 + attempt % 20))
    reader, writer = await asyncio.open_unix_connection(sock=raw)
    writer.write(_frame(Hello(seq=1, version=PROTOCOL_VERSION, pid=os.getpid(), client="bench")))
    await _reply(reader, 1)
    return reader, writer


def _frame(message) -> bytes:
    from gpushare_ext.protocol import encode_frame

    return encode_frame(message)


async def _reply(reader, seq: int):
    """The broker's answer to message ``seq`` (notices in between are skipped)."""
    from gpushare_ext.protocol import decode_broker_message, frame_length

    while True:
        header = await reader.readexactly(4)
        message = decode_broker_message(await reader.readexactly(frame_length(header)))
        if message.reply_to == seq:
            return message


async def _open_loop_session(
    session, plan: tuple[float, float, float, int], start: float, out: tuple[list, list]
) -> None:
    """One session of the open loop: a request every ``period`` s from ``phase`` on,
    whenever the answers come."""
    import asyncio

    from gpushare_ext.protocol import Granted, Release, RequestLease

    reader, writer = session
    phase, period, hold, count = plan
    grants, late = out
    seq = 1
    for k in range(count):
        due = start + phase + k * period
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        seq += 1
        sent = time.perf_counter()
        writer.write(_frame(RequestLease(seq=seq, priority=150, memory_bytes=64 * MIB)))
        reply = await _reply(reader, seq)
        granted = time.perf_counter()
        if not isinstance(reply, Granted):
            raise RuntimeError(f"not granted at once: {type(reply).__name__}")
        grants.append(granted - sent)
        late.append(sent - due)
        await asyncio.sleep(max(0.0, due + hold - time.perf_counter()))
        seq += 1
        writer.write(_frame(Release(seq=seq, lease_id=reply.lease_id)))
        await _reply(reader, seq)


def _open_loop_worker(sock: Path, plans: list, ready_count, go, start, results) -> None:
    """The open loop's sessions of one process, on one asyncio loop: a thread per
    session would put the load generator's own scheduling into the latency."""
    import asyncio

    grants: list[float] = []
    late: list[float] = []
    retried: list = []
    errors: list[str] = []

    async def run() -> None:
        opened = await asyncio.gather(
            *(_open_session(sock, retried) for _ in plans), return_exceptions=True
        )
        sessions = [s for s in opened if not isinstance(s, BaseException)]
        errors.extend(f"connect: {s!r}" for s in opened if isinstance(s, BaseException))
        with ready_count.get_lock():
            ready_count.value += len(plans)
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        done = await asyncio.gather(
            *(
                _open_loop_session(session, plan, start.value, (grants, late))
                for session, plan in zip(sessions, plans, strict=False)
            ),
            return_exceptions=True,
        )
        errors.extend(f"{type(e).__name__}: {e}" for e in done if isinstance(e, BaseException))
        for _, writer in sessions:
            writer.close()

    asyncio.run(run())
    results.put((grants, late, len(retried), errors))


def _thread_worker(sock: Path, plans: list, ready_count, go, start, results) -> None:
    """The closed loop's clients of one process, a thread each."""
    out: list = []
    errors: list = []
    lock = threading.Lock()

    def ready() -> None:
        with lock, ready_count.get_lock():
            ready_count.value += 1

    threads = [
        threading.Thread(
            target=_client_thread, args=(sock, plan, ready, go, out, errors), daemon=True
        )
        for plan in plans
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = [x for a, _, _ in out for x in a]
    second = [x for _, b, _ in out for x in b]
    results.put((first, second, sum(r for _, _, r in out), errors))


def _run_clients(worker, sock: Path, plans: list, workers: int, start_in: float = 0.0) -> dict:
    """Run one client per plan, spread over ``workers`` forked processes; return what
    they measured once all had connected and were let go together."""
    context = multiprocessing.get_context("fork")
    workers = max(1, min(workers, len(plans)))
    shares = [plans[i::workers] for i in range(workers)]
    ready_count = context.Value("i", 0)
    start = context.Value("d", 0.0)  # perf_counter is CLOCK_MONOTONIC: shared by processes
    go = context.Event()
    results = context.Queue()
    processes = [
        track(context.Process(target=worker, args=(sock, share, ready_count, go, start, results)))
        for share in shares
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 300
    while ready_count.value < len(plans) and time.monotonic() < deadline:
        time.sleep(0.01)
    start.value = time.perf_counter() + start_in
    started = time.perf_counter()
    go.set()
    first: list[float] = []
    second: list[float] = []
    retried = 0
    errors: list[str] = []
    for _ in processes:
        a, b, r, e = results.get(timeout=1800)
        first += a
        second += b
        retried += r
        errors += e
    wall = time.perf_counter() - started
    for process in processes:
        process.join(timeout=30)
    return {
        "workers": workers,
        "first": first,
        "second": second,
        "retried": retried,
        "errors": errors,
        "wall": wall,
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _ms(values: list[float]) -> dict:
    ms = 1000.0
    return {
        "p50": round(_percentile(values, 50) * ms, 3),
        "p90": round(_percentile(values, 90) * ms, 3),
        "p99": round(_percentile(values, 99) * ms, 3),
        "max": round(max(values, default=float("nan")) * ms, 3),
        "mean": round(statistics.fmean(values) * ms, 3) if values else None,
    }


def measure(sock: Path, clients: int, requests: int, workers: int) -> dict:
    run = _run_clients(_thread_worker, sock, [requests] * clients, workers)
    grants, cycles = run["first"], run["second"]
    cycle_ms = _ms(cycles)
    return {
        "mode": "closed loop",
        "clients": clients,
        "worker_processes": run["workers"],
        "requests_per_client": requests,
        "cycles": len(cycles),
        "errors": len(run["errors"]),
        "error_examples": sorted(set(run["errors"]))[:5],
        "connects_retried": run["retried"],
        "wall_s": round(run["wall"], 3),
        "grant_ms": _ms(grants),
        "cycle_ms": {"p50": cycle_ms["p50"], "p99": cycle_ms["p99"]},
        "cycles_per_s": round(len(cycles) / run["wall"], 1),
        "messages_per_s": round(2 * len(cycles) / run["wall"], 1),
    }


def measure_open_loop(
    sock: Path, sessions: int, rate: float, hold: float, duration: float, workers: int
) -> dict:
    period = 1.0 / rate
    count = max(1, round(duration * rate))
    plans = [(i * period / sessions, period, hold, count) for i in range(sessions)]
    # Let the threads settle after the go before the first request is due.
    run = _run_clients(_open_loop_worker, sock, plans, workers, start_in=1.0)
    grants, late = run["first"], run["second"]
    grant_ms = _ms(grants)
    return {
        "mode": "open loop",
        "clients": sessions,
        "worker_processes": run["workers"],
        "rate_per_session_hz": rate,
        "hold_s": hold,
        "duration_s": duration,
        "live_leases_about": round(sessions * min(1.0, hold * rate)),
        "requests": len(grants),
        "errors": len(run["errors"]),
        "error_examples": sorted(set(run["errors"]))[:5],
        "connects_retried": run["retried"],
        "wall_s": round(run["wall"], 3),
        "grant_ms": grant_ms,
        "send_late_ms": _ms(late),
        "messages_per_s": round(2 * len(grants) / max(run["wall"] - 1.0, 1e-9), 1),
        "target": f"grant p99 <= {OPEN_LOOP_TARGET_P99_MS:g} ms",
        "met": grant_ms["p99"] <= OPEN_LOOP_TARGET_P99_MS,
    }


# ------------------------------------------------------------------ the core alone


def _h200s(count: int) -> list:
    """``count`` simulated H200s (the fixture's device, numbered and named anew)."""
    from gpushare_ext.broker.hands.inventory import fixture_path, parse_inventory

    document = json.loads(fixture_path("h200").read_text())
    first = document["devices"][0]
    devices = [
        {**first, "index": n, "uuid": f"GPU-00000000-0000-0000-0000-{n:012d}"} for n in range(count)
    ]
    return parse_inventory({**document, "devices": devices}, simulated=True)


def _scheduler(devices: list):
    from gpushare_ext.broker.scheduler import core
    from gpushare_ext.broker.settings.policy import parse_policy

    return core.Scheduler(devices, parse_policy("[defaults]\nmax_leases = 10000\n"))


def _notices(actions: list) -> int:
    from gpushare_ext.broker.scheduler import core

    return sum(isinstance(action, core.NotifyQueued) for action in actions)


def _core_run(leases: int, memory: int, cycles: int) -> dict:
    """µs per event of the scheduler core with ``leases`` leases on one simulated H200."""
    from gpushare_ext.broker.hands.inventory import fixture_path, parse_inventory
    from gpushare_ext.broker.scheduler import core
    from gpushare_ext.protocol import LeaseState, RequestLease

    devices = parse_inventory(json.loads(fixture_path("h200").read_text()), simulated=True)
    devices = devices[:1]
    scheduler = _scheduler(devices)
    now = 1000.0
    sessions = []
    for i in range(leases):
        session = f"S{i}"
        identity = core.Identity(uid=2000 + i % 50, gid=100, pid=40_000 + i, user=f"u{i % 50}")
        scheduler.handle(core.SessionOpened(now=now, session_id=session, identity=identity))
        sessions.append(session)

    def request(i: int, lease_id: str) -> None:
        scheduler.handle(
            core.LeaseRequested(
                now=now, session_id=sessions[i], lease_id=lease_id,
                request=RequestLease(priority=150, memory_bytes=memory),
            )
        )  # fmt: skip

    ids = [f"L{i}" for i in range(leases)]
    for i in range(leases):
        request(i, ids[i])
    running = sum(1 for lease in scheduler.leases.values() if lease.state == LeaseState.RUNNING)
    owner = {lease_id: i for i, lease_id in enumerate(ids)}
    events = notices = 0
    elapsed = 0.0  # in the core only: finding a lease to release is the harness's work
    for r in range(cycles):
        # Release a running lease (the next in line takes its place), ask again, tick.
        lease = next(
            lease for lease in scheduler.leases.values() if lease.state == LeaseState.RUNNING
        )
        i = owner.pop(lease.lease_id)
        ids[i] = f"L{i}x{r}"
        owner[ids[i]] = i
        started = time.perf_counter()
        actions = scheduler.handle(
            core.LeaseReleased(now=now, session_id=sessions[i], lease_id=lease.lease_id)
        )
        request(i, ids[i])
        now += 0.01
        scheduler.handle(core.Tick(now=now))
        elapsed += time.perf_counter() - started
        events += 3
        notices += _notices(actions)
    return {
        "leases": leases,
        "running": running,
        "waiting": leases - running,
        "lease_memory_mib": memory // MIB,
        "events": events,
        "us_per_event": round(elapsed / events * 1e6, 1),
        "notices_per_event": round(notices / events, 1),  # those of the releases
    }


def _waiting_run(waiters: int, cycles: int) -> dict:
    """µs per event while ``waiters`` requests wait for GPU 0 and events happen on GPU 1
    (and at the back of the queue) that leave the waiters' places alone."""
    from gpushare_ext.broker.scheduler import core
    from gpushare_ext.protocol import RequestLease

    scheduler = _scheduler(_h200s(2))
    now = 1000.0

    def session(name: str, n: int) -> str:
        identity = core.Identity(uid=2000 + n % 50, gid=100, pid=40_000 + n, user=f"u{n % 50}")
        scheduler.handle(core.SessionOpened(now=now, session_id=name, identity=identity))
        return name

    def ask(session_id: str, lease_id: str, priority: int, memory: int, device: str) -> list:
        request = RequestLease(priority=priority, memory_bytes=memory, device=device)
        return scheduler.handle(core.LeaseRequested(now=now, session_id=session_id,
                                                    lease_id=lease_id, request=request))  # fmt: skip

    ask(session("holder", 0), "FULL", 250, 140 * GIB, "0")
    for n in range(waiters):
        ask(session(f"W{n}", 1 + n), f"W{n}", 150, 10 * GIB, "0")
    small = [session(f"T{n}", 100_000 + n) for n in range(64)]
    ids = [f"T{n}" for n in range(64)]
    for n, name in enumerate(small):
        ask(name, ids[n], 150, 64 * MIB, "1")
    late = session("late", 200_000)
    events = notices = 0
    elapsed = 0.0
    for r in range(cycles):
        n = r % len(small)
        started = time.perf_counter()
        actions = scheduler.handle(
            core.LeaseReleased(now=now, session_id=small[n], lease_id=ids[n])
        )
        ids[n] = f"T{n}x{r}"
        actions += ask(small[n], ids[n], 150, 64 * MIB, "1")
        actions += ask(late, f"late{r}", 150, 10 * GIB, "0")
        actions += scheduler.handle(
            core.LeaseReleased(now=now, session_id=late, lease_id=f"late{r}")
        )
        now += 0.01
        actions += scheduler.handle(core.Tick(now=now))
        elapsed += time.perf_counter() - started
        events += 5
        notices += _notices(actions)
    return {
        "waiters": waiters,
        "running": 1 + len(small),
        "events": events,
        "us_per_event": round(elapsed / events * 1e6, 1),
        "notices_per_event": round(notices / events, 2),  # the joiner's, once a cycle
    }


def _repeated(run, repeats: int) -> dict:
    """``run()`` ``repeats`` times: its row, with the median µs per event of the runs."""
    rows = [run() for _ in range(repeats)]
    figures = [row["us_per_event"] for row in rows]
    row = {**rows[0], "us_per_event": round(statistics.median(figures), 1)}
    if repeats > 1:
        row["us_per_event_runs"] = figures
    return row


def measure_core(counts: list[int], cycles: int, repeats: int = 1) -> list[dict]:
    rows = []
    for memory, what in ((64 * MIB, "time-sliced"), (1 * GIB, "memory-bound")):
        for leases in counts:
            run = _repeated(lambda: _core_run(leases, memory, cycles), repeats)  # noqa: B023
            row = {"workload": what, **run}
            if what == "time-sliced" and leases >= 1000:
                row["target"] = f"<= {CORE_TARGET_US:g} µs per event"
                row["met"] = row["us_per_event"] <= CORE_TARGET_US
            rows.append(row)
    return rows


def measure_waiting(counts: list[int], cycles: int, repeats: int = 1) -> list[dict]:
    rows = []
    for waiters in counts:
        row = {"workload": "waiting", **_repeated(lambda: _waiting_run(waiters, cycles), repeats)}  # noqa: B023
        if waiters >= 1000:
            row["target"] = f"<= {CORE_TARGET_US:g} µs per event"
            row["met"] = row["us_per_event"] <= CORE_TARGET_US
        rows.append(row)
    return rows


# ------------------------------------------------------------------ the command


@contextlib.contextmanager
def _broker() -> Iterator[Path]:
    """A broker of its own, in a temporary directory: its socket."""
    directory = Path(tempfile.mkdtemp(prefix="gps-bench-", dir="/tmp"))
    broker = track(BrokerProcess(directory, config_toml=CONFIG, log_level="warning"))
    try:
        yield broker.start().socket
    finally:  # also when it never answered
        stop(broker, 60)
        shutil.rmtree(directory, ignore_errors=True)


def _counts(parser: argparse.ArgumentParser, text: str, name: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{name} must be a comma list of numbers, not {text!r}")
    if counts and min(counts) < 1:
        parser.error(f"{name} must be positive")
    return counts


def _print_table(results: list[dict], core_rows: list[dict]) -> None:
    print(
        f"{'mode':>11} {'clients':>7} {'grants':>7} {'grant p50':>10} {'p90':>8} {'p99':>8} "
        f"{'max':>8} {'msgs/s':>8} {'errors':>6}"
    )
    for r in results:
        g = r["grant_ms"]
        grants = r.get("cycles", r.get("requests"))
        print(
            f"{r['mode']:>11} {r['clients']:>7} {grants:>7} {g['p50']:>8.2f}ms {g['p90']:>6.2f}ms "
            f"{g['p99']:>6.2f}ms {g['max']:>6.1f}ms {r['messages_per_s']:>8.0f} {r['errors']:>6}"
        )
    for row in core_rows:
        count = f"{row['waiters']:>5} waiting" if "waiters" in row else f"{row['leases']:>5} leases"
        print(
            f"core {row['workload']:>12}: {count} ({row['running']} running) "
            f"{row['us_per_event']:>8.1f} µs/event, {row.get('notices_per_event', 0):g} notices/event"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.control_plane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--clients", default="1,64,256,1024", help="closed loop: comma list of client counts"
    )
    parser.add_argument(
        "--requests", type=int, default=200, help="request+release cycles per client"
    )
    parser.add_argument(
        "--open-loop", type=int, default=0, metavar="SESSIONS", help="open loop: sessions"
    )
    parser.add_argument("--rate", type=float, default=1.0, help="open loop: requests/s each")
    parser.add_argument("--hold", type=float, default=0.9, help="open loop: seconds held")
    parser.add_argument("--duration", type=float, default=30.0, help="open loop: seconds")
    parser.add_argument("--core-leases", default="", help="core alone: comma list of lease counts")
    parser.add_argument("--core-cycles", type=int, default=1000, help="core alone: cycles")
    parser.add_argument(
        "--core-waiters",
        default="",
        help="core alone: comma list of request counts waiting while other events happen",
    )
    parser.add_argument(
        "--core-repeats", type=int, default=1, help="core alone: runs of each row (median kept)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=max(2, min(8, os.cpu_count() or 2)),
        help="client worker processes (clients are threads spread over them)",
    )
    parser.add_argument(
        "--note",
        action="append",
        default=[],
        help="a line for the results (what a figure means, why a target was missed)",
    )
    parser.add_argument("--out", required=True, help="folder for control_plane.json")
    args = parser.parse_args(argv)
    exit_on_signals()  # a run ended by timeout or a closed terminal stops its broker too
    counts = _counts(parser, args.clients, "--clients")
    core_counts = _counts(parser, args.core_leases, "--core-leases")
    waiting_counts = _counts(parser, args.core_waiters, "--core-waiters")
    if args.core_repeats < 1 or args.core_cycles < 1:
        parser.error("--core-repeats and --core-cycles must be positive")
    if args.requests < 1 or args.open_loop < 0 or args.rate <= 0 or args.duration <= 0:
        parser.error("--requests, --rate and --duration must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    load_before = os.getloadavg()
    # The core first, while this process is small; each broker part on a fresh broker,
    # so the open loop does not inherit the closed loop's journal.
    core_rows = measure_core(core_counts, args.core_cycles, args.core_repeats)
    core_rows += measure_waiting(waiting_counts, args.core_cycles, args.core_repeats)
    results = []
    if counts:
        with _broker() as sock:
            for clients in counts:
                print(f"{clients} client(s) x {args.requests} cycles ...", flush=True)
                results.append(measure(sock, clients, args.requests, args.workers))
    if args.open_loop:
        with _broker() as sock:
            print(f"open loop: {args.open_loop} sessions for {args.duration:g} s ...")
            results.append(
                measure_open_loop(
                    sock, args.open_loop, args.rate, args.hold, args.duration, args.workers
                )
            )
    load_after = os.getloadavg()

    document = {
        **describe(),
        "benchmark": "control_plane",
        "broker": "gpushare broker --simulate h200 (user mode, SQLite journal, one process)",
        "what": "lease request->grant round trip and messages/s; normal priority, 64 MiB, "
        "all granted at once (time-sliced); each client its own connection",
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "results": results,
        "core": core_rows,
        "notes": args.note,
    }
    (out / "control_plane.json").write_text(json.dumps(document, indent=2) + "\n")
    print()
    _print_table(results, core_rows)
    print(f"\nwrote {out / 'control_plane.json'}")
    failed = any(r["errors"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
