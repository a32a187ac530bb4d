"""Fuzz a live broker with a million frames: every frame answered, nothing crashes.

Starts ``gpushare broker --simulate h200`` (no GPU is needed) and runs a few client
processes that each keep one raw connection and send pipelined batches of frames:
valid messages of every type with one to three fields replaced by hostile values
(wrong types, numbers out of range, "²" and "①" as device numbers, huge strings),
unknown types, bytes that are not JSON, arrays nested thousands deep.  Now and then a
client sends a frame that cannot be resynchronised (a length over the limit, or half a
frame and a hang-up) and reconnects; every few thousand frames it reconnects anyway,
which also ends the leases its requests were granted.

Counted: frames sent, replies by type and error code, frames left unanswered (a frame
whose reply did not come within 30 s), connections the broker closed without being
asked to, whether the broker ever exited, its RSS before and after, and the
tracebacks in its log.  Usage::

    python -m benchmarks.fuzz_frames --frames 1000000 --out benchmarks/results/<date>-cpu

writes ``fuzz_frames.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import socket
import struct
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.environment import describe
from benchmarks.stopping import exit_on_signals, track

if TYPE_CHECKING:
    from gpushare_ext.broker.edges.launch import BrokerProcess

CONFIG = """
[broker]
max_connections_per_uid = 100000
max_requests_per_second = 1000000
[defaults]
max_leases = 10000
"""
BATCH = 200
RECONNECT_EVERY = 1_000
HOSTILE = [
    None, True, False, -1, 0, 2**63, -(2**63), 1e308, -1e-308, 0.0, "", "²", "①", "٣",
    "auto", "GPU-", "MIG-", "0", "7", "high", "x" * 5000, [], {}, [[[[]]]], {"a": {"b": []}},
    "\u0000", "\ud7ff", "L" * 64, "L" * 65, 300, 299, 1.0000001, 0.5, 1 << 50, (1 << 50) + 1,
]  # fmt: skip
TEMPLATES = [
    {"type": "hello", "version": 1, "pid": 1, "client": "bench", "notebook": "n", "reclaim": []},
    {"type": "request_lease", "priority": 150, "memory_bytes": 1 << 26, "slice": "auto",
     "device": "auto", "sm_share": 1.0, "label": "fuzz",
     "capabilities": {"gate": True, "yield_flag": False, "instrumented_only": False,
                      "lockable": True}},
    {"type": "release", "lease_id": "L1"},
    {"type": "heartbeat"},
    {"type": "status"},
    {"type": "unwatch"},
    {"type": "register_yield_flag", "lease_id": "L1", "device_index": 0,
     "ipc_handle_hex": "00ff", "offset": 0},
    {"type": "admin", "action": "drain", "device": 9},
    {"type": "admin", "action": "set_policy", "policy_toml": "[defaults]\nmax_leases = 10000\n"},
    {"type": "admin", "action": "cancel", "lease_id": "L999999999"},
]  # fmt: skip


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _nested(rng: random.Random) -> bytes:
    depth = rng.choice([10, 500, 987, 5_000, 50_000])
    if rng.random() < 0.5:
        return b"[" * depth + b"]" * depth
    return b'{"type":"status","seq":1,"x":' + b"[" * depth + b"]" * depth + b"}"


def fuzzed_body(rng: random.Random, seq: int) -> tuple[bytes, str]:
    """One body and what kind of fuzz it is."""
    roll = rng.random()
    if roll < 0.70:
        message = dict(rng.choice(TEMPLATES))
        for _ in range(rng.randint(1, 3)):
            key = rng.choice([*message, "bogus", "seq", "type"])
            message[key] = rng.choice(HOSTILE)
        if rng.random() < 0.9:
            message["seq"] = seq
        try:
            return json.dumps(message).encode(), "mutated"
        except (TypeError, ValueError):
            return b"{}", "mutated"
    if roll < 0.80:
        message = dict(rng.choice(TEMPLATES))
        message["seq"] = seq
        if message["type"] == "hello":
            message["type"] = "status"
        return json.dumps(message).encode(), "valid"
    if roll < 0.88:
        return rng.randbytes(rng.randint(0, 300)), "random bytes"
    if roll < 0.94:
        return _nested(rng), "deep nesting"
    length = rng.choice([1, 100, 100_000, 250_000])
    return json.dumps({"type": "t" * length, "seq": seq}).encode(), "unknown type"


class Reader:
    """Replies from one connection, counted by type and code (StateUpdates are not replies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def read(self, count: int, timeout: float, tally: Counter) -> int:
        from gpushare_ext.protocol import Error, StateUpdate, decode_broker_message

        self.sock.settimeout(timeout)
        got = 0
        while got < count:
            while len(self.buffer) >= 4:
                (length,) = struct.unpack(">I", self.buffer[:4])
                if len(self.buffer) < 4 + length:
                    break
                body = bytes(self.buffer[4 : 4 + length])
                del self.buffer[: 4 + length]
                message = decode_broker_message(body)
                if isinstance(message, StateUpdate):
                    continue
                got += 1
                name = type(message).__name__
                tally[f"{name}:{message.code.value}" if isinstance(message, Error) else name] += 1
                if got == count:
                    return got
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                return got
            if not data:
                return got
            self.buffer += data
        return got


def _connect(path: str) -> tuple[socket.socket, Reader]:
    from gpushare_ext.protocol import PROTOCOL_VERSION, Hello, encode_frame

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reader = Reader(sock)
    sock.sendall(encode_frame(Hello(seq=1, version=PROTOCOL_VERSION, pid=os.getpid())))
    reader.read(1, 30, Counter())
    return sock, reader


def client_main(path: str, frames: int, seed: int, result_queue) -> None:
    rng = random.Random(seed)
    tally: Counter = Counter()
    kinds: Counter = Counter()
    sent = answered = unanswered = dropped = resync = 0
    sock, reader = _connect(path)
    since_connect = 0
    seq = 10
    while sent < frames:
        if rng.random() < 0.002:
            # A frame that cannot be resynchronised: the broker says why, then closes.
            if rng.random() < 0.5:
                sock.sendall(struct.pack(">I", 300_000) + b"{")
            else:
                sock.sendall(struct.pack(">I", 100) + b'{"type":"sta')
                sock.shutdown(socket.SHUT_WR)
            sent += 1
            resync += 1
            got = reader.read(1, 30, tally)
            answered += got
            unanswered += 1 - got
            sock.close()
            sock, reader = _connect(path)
            since_connect = 0
            continue
        batch = []
        for _ in range(min(BATCH, frames - sent)):
            seq += 1
            body, kind = fuzzed_body(rng, seq)
            kinds[kind] += 1
            batch.append(_frame(body))
        try:
            sock.sendall(b"".join(batch))
        except OSError:
            dropped += 1
            sock, reader = _connect(path)
            continue
        got = reader.read(len(batch), 30, tally)
        sent += len(batch)
        answered += got
        if got < len(batch):
            unanswered += len(batch) - got
            dropped += 1
            sock.close()
            sock, reader = _connect(path)
            since_connect = 0
            continue
        since_connect += len(batch)
        if since_connect >= RECONNECT_EVERY:
            sock.close()
            sock, reader = _connect(path)
            since_connect = 0
    sock.close()
    result_queue.put(
        {
            "sent": sent,
            "answered": answered,
            "unanswered": unanswered,
            "closed_unasked": dropped,
            "resync_frames": resync,
            "replies": dict(tally),
            "kinds": dict(kinds),
        }
    )


def _rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / (1024 * 1024)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="20,000 frames (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.frames = 20_000
    return args


def _run_clients(
    broker: BrokerProcess, args: argparse.Namespace, started: float
) -> tuple[list[dict], list[tuple[float, float]]]:
    """Run the fuzzing clients to their end: what each counted, and the broker's RSS
    sampled meanwhile (seconds since ``started``, MiB)."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    per_client = args.frames // args.clients
    workers = [
        track(
            context.Process(
                target=client_main, args=(str(broker.socket), per_client, args.seed + i, queue)
            )
        )
        for i in range(args.clients)
    ]
    for worker in workers:
        worker.start()
    # The broker's RSS over the run: a plateau is warm-up, a steady climb a leak.
    samples: list[tuple[float, float]] = []
    results = []
    while len(results) < len(workers):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: time for a sample
            if broker.alive():
                samples.append(
                    (round(time.monotonic() - started, 1), round(_rss_mib(broker.pid), 1))
                )
    for worker in workers:
        worker.join()
    return results, samples


def _summary(
    results: list[dict],
    total: Counter,
    samples: list[tuple[float, float]],
    seen: dict,
    took: float,
) -> dict:
    """The run's figures; ``seen``: what was seen of the broker (alive, exit status,
    log, RSS before and after)."""
    rss_after = seen["rss_after"]
    return {
        "frames_sent": sum(r["sent"] for r in results),
        "answered": sum(r["answered"] for r in results),
        "unanswered": sum(r["unanswered"] for r in results),
        "closed_unasked": sum(r["closed_unasked"] for r in results),
        "unresynchronisable_frames": sum(r["resync_frames"] for r in results),
        "broker_alive_at_end": seen["alive"],
        "broker_exit_status_on_sigterm": seen["exit_status"],
        "tracebacks_in_log": seen["log"].count("Traceback"),
        "internal_errors": total.get("Error:internal", 0),
        "log_bytes": len(seen["log"].encode()),
        "broker_rss_mib_before": round(seen["rss_before"], 1),
        "broker_rss_mib_after": round(rss_after, 1) if rss_after else None,
        "broker_rss_mib_second_half_growth": (
            round(samples[-1][1] - samples[len(samples) // 2][1], 1) if len(samples) > 3 else None
        ),
        "seconds": round(took, 1),
        "frames_per_second": round(sum(r["sent"] for r in results) / took),
    }


def _passed(summary: dict) -> bool:
    return (
        summary["unanswered"] == 0
        and summary["closed_unasked"] == 0
        and summary["broker_alive_at_end"]
        and summary["tracebacks_in_log"] == 0
        and summary["internal_errors"] == 0
    )


def main() -> int:
    args = _parse_args()

    from gpushare_ext.broker.edges.launch import BrokerProcess

    exit_on_signals()  # ended by a signal (or an error), it still stops the broker and clients
    directory = Path(tempfile.mkdtemp(prefix="gps-fuzz-", dir="/tmp"))
    broker = track(BrokerProcess(directory, config_toml=CONFIG, log_level="info")).start()
    started = time.monotonic()
    rss_before = _rss_mib(broker.pid)
    results, samples = _run_clients(broker, args, started)
    took = time.monotonic() - started
    alive = broker.alive()
    seen = {
        "alive": alive,
        "rss_before": rss_before,
        "rss_after": _rss_mib(broker.pid) if alive else None,
        "exit_status": broker.stop(),
        "log": broker.output(),
    }
    shutil.rmtree(directory, ignore_errors=True)

    total: Counter = Counter()
    kinds: Counter = Counter()
    for result in results:
        total.update(result["replies"])
        kinds.update(result["kinds"])
    summary = _summary(results, total, samples, seen, took)
    record = {
        **describe(),
        "clients": args.clients,
        "seed": args.seed,
        "summary": summary,
        "replies": dict(sorted(total.items())),
        "fuzz_kinds": dict(sorted(kinds.items())),
        "broker_rss_mib_samples": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fuzz_frames.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'measure':32} value")
    for key, value in summary.items():
        print(f"{key:32} {value}")
    return 0 if _passed(summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
