"""Crash soak: ``kill -9`` the broker over and over while notebooks keep asking for leases,
and ``kill -9`` the notebooks too.

Starts ``gpushare broker --simulate h200`` and a few client processes, each a real
:class:`~gpushare_ext.runtime.session.GpuSession` (the runtime notebooks use, with its
reconnect and reclaim) looping: ask for a lease (a random priority band and 4-60 GiB,
so requests queue and preempt each other), hold it for a moment calling
``safe_point()``, release it.  Meanwhile the broker is killed with SIGKILL at random
moments and started again on the same socket and journal, ``--kills`` times; and, with
the chance ``--client-kill-chance`` per broker kill, a client is killed with SIGKILL too
(at a random moment while the broker runs, or a quarter of the time while it is down)
and a fresh client is started in its place.

Counted; a count marked (0) must be 0, else the run exits 1:

* requests made, granted, refused (policy says why: a typed answer), left unanswered
  in the queue within ``--answer-timeout`` s (0), timed out waiting for a broker that
  was away (0), failed with "broker unavailable" (0: a request made while the broker
  restarts waits for it, bounded -- at once is counted apart from after the
  reconnect's 120 s deadline), other client errors (0);
* live leases lost (0): a lease a cell held that the runtime reported revoked, or that
  was held across a reconnect and not reclaimed in it;
* granted twice (0): one lease id granted to two acquires (every client's log, the
  killed ones' too), listed twice in one status, or numbered at or past the journal's
  reserved next number (the next broker would hand it out again);
* memory over capacity (0): the running and paused leases of a device holding more
  than it has, in any status probe (every ``--probe-every`` s) or in the journal at a
  kill; the probes that would fit but for leases the journal had as evicted at the kill
  are also counted apart;
* killed clients' leases kept (0): a lease of a killed client's pid still in a status
  more than :data:`DEAD_LEASE_BOUND_S` after the kill (counted from the broker's return
  where it was down), and leases left once every client closed its session (0);
* journal not intact (0): ``PRAGMA integrity_check`` other than ``ok`` on the journal,
  opened read-only after each kill before the restart, and after the final stop;
* reclaim time: from each restart (the new broker process spawned) to each lease it
  reclaimed for a surviving session (the journal's ``reclaimed`` notes), p50/p99/max;
  and the surviving sessions' leases neither reclaimed nor ended by the next kill;
* the longest time a ``safe_point()`` was held, sessions still held at the end (0),
  clients that did not finish (0) or died without our kill (0), broker exits that were
  not our kills (0), tracebacks in its log (0), actuator steps the journal still lists
  as applied after the final clean stop (0).

Usage::

    python -m benchmarks.crash_soak --kills 1000 --clients 6 --out benchmarks/results/<date>-cpu

writes ``crash_soak.json`` and prints a table; exits 1 if any count that must be 0 is not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import sqlite3
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
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
MIB = 1024**2
MUST_BE_ZERO = (
    "unanswered_requests", "timed_out_waiting_for_the_broker",
    "failed_at_once_broker_unavailable", "gave_up_waiting_for_the_broker", "client_errors",
    "live_leases_lost", "granted_twice", "memory_over_capacity", "killed_clients_leases_kept",
    "leases_left_after_clients_closed", "journal_not_intact", "sessions_held_at_end",
    "clients_that_did_not_finish", "clients_that_died_unasked", "broker_exits_not_ours",
    "pending_actuations_after_stop", "tracebacks_in_log",
)  # fmt: skip
PRIORITIES = ["low", "normal", "high"]
#: How long a killed client's leases may stay at a broker that runs (a dropped
#: connection of a dead process ends its leases at once; this leaves room for a busy VM).
DEAD_LEASE_BOUND_S = 5.0
#: Of the client kills, the share made while the broker is down.
KILLED_WHILE_DOWN = 0.25
HELD_STATES = ("running", "paused")  # what holds device memory (evicted moved it off)
GRANTED_STATES = ("running", "paused", "evicted")
SAMPLES = 10  # kept of each kind of failure


# ---------------------------------------------------------------- a client process


def client_main(socket_path: str, seed: int, stop_file: str, log: str, timeout_s: float) -> None:
    """One notebook's worth of traffic through the real runtime session.

    Each request's outcome is one line appended to ``log`` as it ends, so what a client
    did before it was killed is still counted; a client that stops cleanly ends the log
    with ``{"end": true, ...}``.
    """
    from gpushare_ext.runtime.session import GpuSession

    rng = random.Random(seed)
    session = GpuSession(socket_path, notebook=f"soak-{seed}.ipynb")
    with open(log, "a", buffering=1) as out:
        while not os.path.exists(stop_file):
            record = _one_request(session, rng, timeout_s)
            out.write(json.dumps(record) + "\n")
            if record["outcome"] != "granted":
                time.sleep(0.2 if record["outcome"] in ("unavailable", "error") else 0.0)
                continue
            time.sleep(rng.uniform(0.0, 0.2))
        block = session.control_block
        held = bool(block is not None and (block.paused or block.gate_closed))
        session.close()
        out.write(json.dumps({"end": True, "held_at_end": held}) + "\n")


def _one_request(session, rng: random.Random, timeout_s: float) -> dict:
    """Ask, hold and release one lease; what happened, as one log record."""
    from gpushare_ext.client import BrokerError
    from gpushare_ext.protocol import ErrorCode, priority_value
    from gpushare_ext.runtime.session import LeaseRefused, LeaseTimeout

    priority = rng.choice(PRIORITIES)
    gib = rng.choice([4, 16, 40, 60])
    options = session.merged(
        priority=priority_value(priority), memory_bytes=gib * GIB, timeout_s=timeout_s
    )
    record: dict = {"priority": priority, "gib": gib}
    began = time.monotonic()
    try:
        handle = session.acquire(options, label=f"soak {priority}")
    except LeaseTimeout as exc:
        away = "went away" in str(exc)  # cell_lines.broker_away_timed_out_words
        return _failed(record, "broker_timed_out" if away else "unanswered", exc, began)
    except LeaseRefused as exc:
        lost = "revoked" in str(exc) or "did not keep" in str(exc)
        return _failed(record, "lost" if lost else "refused", exc, began)
    except BrokerError as exc:
        unavailable = exc.code == ErrorCode.UNAVAILABLE
        return _failed(record, "unavailable" if unavailable else "error", exc, began)
    except Exception as exc:  # anything else a cell would have shown as its error
        return _failed(record, "error", exc, began)
    record.update(outcome="granted", lease=handle.lease_id, s=round(time.monotonic() - began, 3))
    _hold(session, handle, rng, record)
    return record


def _failed(record: dict, outcome: str, exc: BaseException, began: float) -> dict:
    record.update(
        outcome=outcome, s=round(time.monotonic() - began, 3), detail=f"{type(exc).__name__}: {exc}"
    )
    return record


def _hold(session, handle, rng: random.Random, record: dict) -> None:
    """Hold the lease a moment, calling ``safe_point()``, then release it.

    A connection made while it was held (a broker restart) must have reclaimed it or
    told the cell it is gone: a lease neither is one the broker dropped unsaid.
    """
    from gpushare_ext.client import BrokerError

    generation = session.connection.generation
    longest = 0.0
    until = time.monotonic() + rng.uniform(0.05, 0.6)
    while time.monotonic() < until:
        held_from = time.monotonic()
        session.safe_point()
        longest = max(longest, time.monotonic() - held_from)
        time.sleep(0.01)
    with session._lock:  # a reconnect settles its leases under it: both seen, or neither
        reconnects = session.connection.generation - generation
        what = [text for _, text in handle.events]
    record.update(
        hold_s=round(longest, 3),
        paused=any(text.startswith("paused") for text in what),
        reclaimed=any(text.startswith("reclaimed") for text in what),
        released_while_away=session.connection.live_client() is None,
    )
    if handle.state == "revoked":
        record.update(outcome="lost", detail=handle.revoked)
    elif reconnects and not record["reclaimed"]:
        record.update(outcome="lost", detail=f"held across {reconnects} reconnects, not reclaimed")
    with contextlib.suppress(BrokerError):
        session.release(handle)


# ---------------------------------------------------------------- the clients


@dataclass
class Client:
    seed: int
    process: multiprocessing.process.BaseProcess
    log: Path
    killed: bool = False


class Clients:
    """The client processes: started, killed at random, replaced."""

    def __init__(self, directory: Path, socket: Path, args: argparse.Namespace) -> None:
        self._directory = directory
        self._socket = socket
        self._args = args
        self._context = multiprocessing.get_context("fork")
        self.stop_file = directory / "stop"
        self.live: list[Client] = []
        self.every: list[Client] = []
        self.died_unasked: list[str] = []  # clients found dead before their kill
        self._next_seed = args.seed

    def start(self) -> Client:
        seed = self._next_seed
        self._next_seed += 1
        log = self._directory / f"client-{seed}.jsonl"
        process = self._context.Process(
            target=client_main,
            args=(
                str(self._socket),
                seed,
                str(self.stop_file),
                str(log),
                self._args.answer_timeout,
            ),
        )
        track(process).start()
        client = Client(seed, process, log)
        self.live.append(client)
        self.every.append(client)
        return client

    def kill_one(self, rng: random.Random) -> tuple[int, int]:
        """SIGKILL a random client, reap it, start another: (the dead pid, the new pid)."""
        client = self.live.pop(rng.randrange(len(self.live)))
        if not client.process.is_alive():
            self.died_unasked.append(f"client {client.seed}: exit {client.process.exitcode}")
        client.process.kill()
        client.process.join(timeout=10)  # reaped, as a kernel's manager would
        client.killed = True
        fresh = self.start()
        return int(client.process.pid or 0), int(fresh.process.pid or 0)

    def pids(self) -> set[int]:
        return {int(c.process.pid or 0) for c in self.live if c.process.is_alive()}

    def finish(self, timeout_s: float, watch: Watch) -> None:
        """Ask every client to stop, probing the broker while they finish their leases."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout_s
        while any(c.process.is_alive() for c in self.live) and time.monotonic() < deadline:
            watch.probe()
            time.sleep(0.5)
        for client in self.live:
            if client.process.is_alive():
                client.process.kill()
            client.process.join(timeout=10)
            if client.process.exitcode != 0:
                self.died_unasked.append(f"client {client.seed}: exit {client.process.exitcode}")


# ---------------------------------------------------------------- status probes


@dataclass
class Watch:
    """What every status probe checks: capacity, lease ids, killed clients' leases."""

    socket: Path
    dead: dict[int, float] = field(default_factory=dict)  # pid -> its leases end from then
    kept: dict[str, str] = field(default_factory=dict)  # a dead pid's lease seen past the bound
    over_capacity: list[str] = field(default_factory=list)
    listed_twice: list[str] = field(default_factory=list)
    probes: int = 0
    unanswered: int = 0
    leases_seen_max: int = 0
    back_at: float = 0.0  # when the broker last answered after a restart
    over_capacity_s: list[float] = field(default_factory=list)  # each, how long after one
    # Open leases the journal had as evicted at the last kill (their memory off the device),
    # and the over-capacity probes that fit the device but for those.
    evicted_at_kill: set[str] = field(default_factory=set)
    over_only_by_restored_evictions: int = 0

    def client_killed(self, pid: int, fresh_pid: int) -> None:
        self.dead[pid] = time.monotonic()
        self.dead.pop(fresh_pid, None)  # a reused pid is a live client again

    def broker_back(self) -> None:
        """A broker that was down could not end anything: the bound counts from now."""
        now = self.back_at = time.monotonic()
        for pid in self.dead:
            self.dead[pid] = max(self.dead[pid], now)

    def probe(self):
        """One status; None if the broker did not answer (it may be starting)."""
        from gpushare_ext.client import BrokerClient, BrokerError

        self.probes += 1
        try:
            with BrokerClient(self.socket, client="bench", connect_timeout=2) as probe:
                snapshot = probe.status()
        except BrokerError:
            self.unanswered += 1
            return None
        self.look(snapshot)
        return snapshot

    def look(self, snapshot) -> None:
        now = time.monotonic()
        self.leases_seen_max = max(self.leases_seen_max, len(snapshot.leases))
        ids = Counter(lease.lease_id for lease in snapshot.leases)
        self.listed_twice += [f"{i} listed {n} times" for i, n in ids.items() if n > 1]
        held: Counter[int] = Counter()
        for lease in snapshot.leases:
            if lease.state.value in HELD_STATES and lease.device_index is not None:
                held[lease.device_index] += lease.memory_bytes
            since = self.dead.get(lease.pid or -1)
            if since is not None and now - since > DEAD_LEASE_BOUND_S:
                self.kept.setdefault(
                    lease.lease_id,
                    f"{lease.lease_id} of killed pid {lease.pid}: {lease.state.value} "
                    f"{now - since:.1f} s after the kill",
                )
        for device in snapshot.devices:
            self._check_capacity(device, held[device.info.index], snapshot.leases, now)

    def _check_capacity(self, device, held: int, leases, now: float) -> None:
        total, index = device.info.memory_total_mib, device.info.index
        if held <= total * MIB and device.memory_leased_mib <= total:
            return
        self.over_capacity_s.append(now - self.back_at)
        restored = sum(
            lease.memory_bytes
            for lease in leases
            if lease.lease_id in self.evicted_at_kill
            and lease.state.value in HELD_STATES
            and lease.device_index == index
        )
        self.over_only_by_restored_evictions += held - restored <= total * MIB
        self.over_capacity.append(
            f"status {now - self.back_at:.2f} s after a restart: GPU {index} holds "
            f"{held // MIB} MiB in leases ({device.memory_leased_mib} MiB said) of {total} "
            f"MiB, {restored // MIB} MiB of them in leases the journal had as evicted: "
            f"{_leases_text(leases)}"
        )


def _leases_text(leases) -> str:
    return ", ".join(
        f"{lease.lease_id} pid {lease.pid} {lease.state.value} {lease.memory_bytes // GIB} GiB "
        f"{lease.since_s:.1f} s" + (f" ({lease.reason})" if lease.reason else "")
        for lease in leases
    )


# ---------------------------------------------------------------- the journal


@dataclass
class JournalLook:
    integrity: str
    over_capacity: list[str]
    numbers_past_reserved: list[str]
    open_leases: list[tuple[str, int, str]]  # lease id, pid, state
    reclaimed: list[tuple[str, float]]  # lease id, when (wall clock)
    ended: dict[str, str]  # lease id -> end reason, of the leases asked about


def look_at_journal(
    path: Path, capacity_mib: dict[str, int], since: float, asked: list[str]
) -> JournalLook:
    """The journal as the dead broker left it, read-only (nothing here may change what
    the next broker recovers): its integrity and, where it is intact, what its open
    leases hold, its lease numbers, the reclaims since ``since`` and how the ``asked``
    leases ended."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        return JournalLook(f"cannot open: {exc}", [], [], [], [], {})
    try:
        integrity = "; ".join(str(row[0]) for row in db.execute("PRAGMA integrity_check"))
        if integrity != "ok":
            return JournalLook(integrity, [], [], [], [], {})
        return _read_journal(db, integrity, capacity_mib, since, asked)
    except sqlite3.Error as exc:
        return JournalLook(f"unreadable: {exc}", [], [], [], [], {})
    finally:
        db.close()


def _read_journal(
    db: sqlite3.Connection,
    integrity: str,
    capacity_mib: dict[str, int],
    since: float,
    asked: list[str],
) -> JournalLook:
    held = db.execute(
        "SELECT slot, SUM(memory_bytes) FROM lease_records WHERE ended_at IS NULL "
        f"AND state IN {HELD_STATES!r} GROUP BY slot"
    ).fetchall()
    over = [
        f"journal: slot {slot} holds {int(total) // MIB} MiB of {capacity_mib[slot]} MiB"
        for slot, total in held
        if slot in capacity_mib and int(total) > capacity_mib[slot] * MIB
    ]
    reserved = int(
        (db.execute("SELECT value FROM meta WHERE key='next_lease'").fetchone() or [1])[0]
    )
    past = [
        f"{lease_id} at or past the reserved next number {reserved}"
        for (lease_id,) in db.execute("SELECT lease_id FROM lease_records")
        if (number := re.match(r"L(\d+)", lease_id)) and int(number[1]) >= reserved
    ]
    open_leases = db.execute(
        "SELECT lease_id, pid, state FROM lease_records WHERE ended_at IS NULL"
    ).fetchall()
    reclaimed = db.execute(
        "SELECT lease_id, at FROM history WHERE kind='reclaimed' AND at >= ?", (since,)
    ).fetchall()
    ended = dict(
        db.execute(
            "SELECT lease_id, COALESCE(end_reason, '') FROM lease_records "
            f"WHERE ended_at IS NOT NULL AND lease_id IN ({','.join('?' * len(asked))})",
            asked,
        )
    )
    return JournalLook(integrity, over, past, open_leases, reclaimed, ended)


@dataclass
class Reclaims:
    """The leases of surviving sessions open at a kill, and how the next broker did."""

    seconds: list[float] = field(default_factory=list)  # restart -> reclaimed
    waiting: set[str] = field(default_factory=set)  # open at the last kill, client alive
    not_reclaimed: Counter = field(default_factory=Counter)  # why, by the next kill

    def after_kill(self, look: JournalLook, restarted_at: float | None, alive: set[int]) -> None:
        reclaimed = {lease_id for lease_id, _ in look.reclaimed}
        if restarted_at is not None:
            self.seconds += [at - restarted_at for _, at in look.reclaimed]
        still_open = {lease_id for lease_id, _, _ in look.open_leases}
        for lease_id in self.waiting - reclaimed:
            if lease_id in look.ended:
                self.not_reclaimed[f"ended: {look.ended[lease_id]}"] += 1
            elif lease_id in still_open:
                self.not_reclaimed["still open, not yet reclaimed"] += 1
            else:
                self.not_reclaimed["gone from the journal"] += 1
        self.waiting = {
            lease_id
            for lease_id, pid, state in look.open_leases
            if pid in alive and state in GRANTED_STATES
        }


# ---------------------------------------------------------------- the soak


@dataclass
class Soak:
    args: argparse.Namespace
    broker: object
    clients: Clients
    watch: Watch
    rng: random.Random
    capacity_mib: dict[str, int] = field(default_factory=dict)
    reclaims: Reclaims = field(default_factory=Reclaims)
    journal: Counter = field(default_factory=Counter)
    journal_samples: list[str] = field(default_factory=list)
    unexpected_exits: list[object] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    restarted_at: float | None = None  # wall clock: the current broker's spawn
    client_kills: Counter = field(default_factory=Counter)

    def run(self) -> None:
        for _ in range(self.args.kills):
            kill_client = self.rng.random() < self.args.client_kill_chance
            while_down = kill_client and self.rng.random() < KILLED_WHILE_DOWN
            interval = self.rng.uniform(0.3, 2.5)
            kill_at = self.rng.uniform(0, interval) if kill_client and not while_down else None
            self.traffic(interval, kill_at)
            self.kill_broker()
            if while_down:
                self.kill_client("while the broker was down")
            self.check_journal()
            self.restart()
        self.traffic(5.0, None)  # the last restart settles

    def traffic(self, seconds: float, kill_client_at: float | None) -> None:
        """Let the clients run ``seconds``, probing the broker, and kill one client at
        ``kill_client_at`` s if given."""
        began = time.monotonic()
        next_probe = began
        while (now := time.monotonic()) < began + seconds:
            if kill_client_at is not None and now >= began + kill_client_at:
                self.kill_client("while the broker ran")
                kill_client_at = None
            if now >= next_probe:
                self.watch.probe()
                next_probe = time.monotonic() + self.args.probe_every
            wake = min(next_probe, began + seconds)
            if kill_client_at is not None:
                wake = min(wake, began + kill_client_at)
            time.sleep(max(0.0, wake - time.monotonic()))

    def kill_client(self, when: str) -> None:
        dead, fresh = self.clients.kill_one(self.rng)
        self.watch.client_killed(dead, fresh)
        self.client_kills[when] += 1

    def kill_broker(self) -> None:
        if not self.broker.alive():
            self.unexpected_exits.append(self.broker.process.returncode)
        code = self.broker.stop(signal.SIGKILL)
        if code != -signal.SIGKILL:
            self.unexpected_exits.append(code)

    def check_journal(self) -> None:
        look = look_at_journal(
            self.broker.journal_path,
            self.capacity_mib,
            self.restarted_at or 0.0,
            sorted(self.reclaims.waiting),
        )
        self.journal["looks"] += 1
        if look.integrity != "ok":
            self.journal["not_intact"] += 1
            self.journal_samples.append(f"integrity_check: {look.integrity}")
        self.journal["over_capacity"] += len(look.over_capacity)
        self.journal["numbers_past_reserved"] += len(look.numbers_past_reserved)
        self.journal_samples += look.over_capacity + look.numbers_past_reserved
        self.reclaims.after_kill(look, self.restarted_at, self.clients.pids())
        self.watch.evicted_at_kill = {i for i, _, state in look.open_leases if state == "evicted"}

    def restart(self) -> None:
        self.restarted_at = time.time()
        began = time.monotonic()
        self.broker.start()
        self.restart_s.append(time.monotonic() - began)
        self.watch.broker_back()


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile (None of nothing)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(share * len(ordered)) - 1)], 3)


def tally(clients: list[Client]) -> tuple[Counter, dict]:
    """Every client's log added up: outcomes, granted lease ids, samples of failures."""
    counts: Counter = Counter()
    granted: Counter = Counter()
    samples: dict[str, list[str]] = {}
    for client in clients:
        ended = False
        for line in client.log.read_text().splitlines() if client.log.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by the client's kill
            if record.get("end"):
                ended = True
                counts["held_at_end"] += bool(record["held_at_end"])
                continue
            _count_record(record, counts, granted, samples, client.killed)
        counts["did_not_finish"] += not ended and not client.killed
    twice = [f"{lease_id} granted {n} times" for lease_id, n in granted.items() if n > 1]
    counts["granted_twice"] = len(twice)
    samples["granted_twice"] = twice[:SAMPLES]
    return counts, samples


def _count_record(
    record: dict, counts: Counter, granted: Counter, samples: dict, killed: bool
) -> None:
    from gpushare_ext.runtime.connection import RECONNECT_DEADLINE_S as deadline

    outcome = record["outcome"]
    counts["requests"] += 1
    counts[outcome] += 1
    if outcome == "unavailable":
        # At once: before the reconnect's own deadline could have ended the wait.
        outcome = "unavailable_at_once" if record["s"] < deadline else "unavailable_gave_up"
        counts[outcome] += 1
    if "lease" in record:
        granted[record["lease"]] += 1
        counts["granted_total"] += 1
        counts["by_killed_clients"] += killed
    counts["paused"] += bool(record.get("paused"))
    counts["reclaimed"] += bool(record.get("reclaimed"))
    counts["released_while_away"] += bool(record.get("released_while_away"))
    counts["longest_hold_ms"] = max(counts["longest_hold_ms"], int(record.get("hold_s", 0) * 1000))
    if outcome not in ("granted", "refused"):
        kept = samples.setdefault(outcome, [])
        if len(kept) < SAMPLES:
            kept.append(f"{record['priority']} {record['gib']} GiB after {record['s']} s: "
                        f"{record.get('detail', '')}")  # fmt: skip


def summarize(soak: Soak, counts: Counter, final: dict, took: float) -> dict:
    watch, reclaims = soak.watch, soak.reclaims
    return {
        "broker_kills": soak.args.kills,
        "client_kills": sum(soak.client_kills.values()),
        "client_kills_while_the_broker_was_down": soak.client_kills["while the broker was down"],
        "requests": counts["requests"],
        "granted": counts["granted_total"],
        "granted_to_clients_killed_later": counts["by_killed_clients"],
        "refused_with_reason": counts["refused"],
        "unanswered_requests": counts["unanswered"],
        "timed_out_waiting_for_the_broker": counts["broker_timed_out"],
        "failed_at_once_broker_unavailable": counts["unavailable_at_once"],
        "gave_up_waiting_for_the_broker": counts["unavailable_gave_up"],
        "client_errors": counts["error"],
        "live_leases_lost": counts["lost"],
        "granted_twice": counts["granted_twice"]
        + len(watch.listed_twice)
        + soak.journal["numbers_past_reserved"],
        "memory_over_capacity": len(watch.over_capacity) + soak.journal["over_capacity"],
        "memory_over_capacity_latest_s_after_a_restart": percentile(watch.over_capacity_s, 1.0),
        "memory_over_capacity_but_for_leases_evicted_at_the_kill": (
            watch.over_only_by_restored_evictions
        ),
        "killed_clients_leases_kept": len(watch.kept),
        "leases_left_after_clients_closed": final["leases_left"],
        "journal_looks": soak.journal["looks"] + 1,
        "journal_not_intact": soak.journal["not_intact"] + (final["integrity"] != "ok"),
        "leases_paused_by_preemption": counts["paused"],
        "leases_reclaimed_after_a_kill": counts["reclaimed"],
        "leases_released_while_the_broker_was_away": counts["released_while_away"],
        "reclaims_timed": len(reclaims.seconds),
        "reclaim_s_p50": percentile(reclaims.seconds, 0.50),
        "reclaim_s_p99": percentile(reclaims.seconds, 0.99),
        "reclaim_s_max": percentile(reclaims.seconds, 1.0),
        "surviving_leases_not_reclaimed_by_the_next_kill": dict(reclaims.not_reclaimed),
        "sessions_held_at_end": counts["held_at_end"],
        "clients_that_did_not_finish": counts["did_not_finish"],
        "clients_that_died_unasked": len(soak.clients.died_unasked),
        "longest_safe_point_hold_s": round(counts["longest_hold_ms"] / 1000, 2),
        "broker_exits_not_ours": len(soak.unexpected_exits),
        "broker_alive_before_final_stop": final["alive"],
        "final_sigterm_exit_status": final["status"],
        "pending_actuations_after_stop": final["pending"],
        "tracebacks_in_log": final["tracebacks"],
        "restart_s_p50": percentile(soak.restart_s, 0.50),
        "restart_s_p99": percentile(soak.restart_s, 0.99),
        "status_probes": watch.probes,
        "status_probes_unanswered": watch.unanswered,
        "leases_in_a_status_max": watch.leases_seen_max,
        "seconds": round(took, 1),
    }


def _pending_actuations(journal: Path) -> int:
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return int(
            db.execute("SELECT COUNT(*) FROM actuations WHERE undone_at IS NULL").fetchone()[0]
        )
    finally:
        db.close()


def finish(soak: Soak) -> dict:
    """Stop the clients, look at what they left, stop the broker cleanly, look again."""
    soak.clients.finish(soak.args.answer_timeout + 60, soak.watch)
    time.sleep(1.0)  # the last releases reach the broker
    snapshot = soak.watch.probe()
    left = [lease.lease_id for lease in snapshot.leases] if snapshot is not None else ["?"]
    alive = soak.broker.alive()
    status = soak.broker.stop(signal.SIGTERM)
    look = look_at_journal(
        soak.broker.journal_path,
        soak.capacity_mib,
        soak.restarted_at or 0.0,
        sorted(soak.reclaims.waiting),
    )
    soak.reclaims.after_kill(look, soak.restarted_at, set())
    log = soak.broker.output()
    return {
        "leases_left": len(left),
        "left": left[:SAMPLES],
        "alive": alive,
        "status": status,
        "integrity": look.integrity,
        "pending": _pending_actuations(soak.broker.journal_path),
        "tracebacks": log.count("Traceback"),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=20261201)
    # Long enough for any request to age past every band (120 points a minute): a
    # request still without an answer then was lost, not merely outranked.
    parser.add_argument("--answer-timeout", type=float, default=240.0)
    parser.add_argument(
        "--client-kill-chance", type=float, default=0.3,
        help="the chance, per broker kill, that a client is killed too (default 0.3)",
    )  # fmt: skip
    parser.add_argument("--probe-every", type=float, default=0.5, help="status probes (s)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="5 kills (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.kills = 5
        args.client_kill_chance = max(args.client_kill_chance, 0.8)
    return args


def main() -> int:
    args = parse_args()
    exit_on_signals()  # ended by a signal (or an error), it still stops the broker and clients

    # The clients' code is imported once, here: each forked client runs what this run
    # started with, not whatever an edit of the tree left on disk when it was forked.
    import gpushare_ext.runtime.session  # noqa: F401
    from gpushare_ext.broker.edges.launch import BrokerProcess

    directory = Path(tempfile.mkdtemp(prefix="gps-soak-", dir="/tmp"))
    broker = track(BrokerProcess(directory, config_toml=CONFIG, log_level="info")).start()
    clients = Clients(directory, broker.socket, args)
    watch = Watch(broker.socket)
    soak = Soak(args, broker, clients, watch, random.Random(args.seed))
    first = watch.probe()
    assert first is not None, "the broker did not answer its first status"
    soak.capacity_mib = {str(d.info.index): d.info.memory_total_mib for d in first.devices}
    for _ in range(args.clients):
        clients.start()
    started = time.monotonic()
    soak.run()
    final = finish(soak)
    took = time.monotonic() - started
    counts, samples = tally(clients.every)
    summary = summarize(soak, counts, final, took)
    samples.update(
        killed_clients_leases_kept=list(watch.kept.values())[:SAMPLES],
        memory_over_capacity=(watch.over_capacity + soak.journal_samples)[:SAMPLES],
        listed_twice=watch.listed_twice[:SAMPLES],
        leases_left_after_clients_closed=final["left"] if final["leases_left"] else [],
        broker_exits_not_ours=[str(code) for code in soak.unexpected_exits[:SAMPLES]],
        clients_that_died_unasked=clients.died_unasked[:SAMPLES],
    )
    record = {
        **describe(),
        "clients": args.clients,
        "seed": args.seed,
        "client_kill_chance": args.client_kill_chance,
        "dead_lease_bound_s": DEAD_LEASE_BOUND_S,
        "summary": summary,
        "samples": {key: value for key, value in samples.items() if value},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "crash_soak.json").write_text(json.dumps(record, indent=2) + "\n")
    failed = any(summary[key] for key in MUST_BE_ZERO) or not final["alive"]
    if failed:
        print(f"kept the broker's log, journal and client logs for a look: {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{'measure':56} value")
    for key, value in summary.items():
        print(f"{key:56} {value}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
