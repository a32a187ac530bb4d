"""Talking to a real broker at the byte level, and holding leases from other processes.

:class:`RawClient` speaks frames by hand so tests can send what no well-behaved client
would (half a frame, an oversized header, not JSON).  :func:`start_holder` runs
``lease_holder.py`` in a subprocess that holds one lease until killed.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import (
    PROTOCOL_VERSION,
    BrokerMessage,
    FrameReader,
    Hello,
    Snapshot,
    StatusReply,
    StatusRequest,
    decode_broker_message,
    encode_frame,
    encode_json,
)

HOLDER = Path(__file__).with_name("lease_holder.py")
GIB = 1024**3


def evict_low_for_high(low: RawClient, high: RawClient) -> None:
    """``low`` (hello said) holds 100 GiB at low priority; ``high`` asks as much at high
    priority, waits, and is granted once the low lease is evicted (lease ids L1, L2)."""
    from gpushare_ext.protocol import Granted, Queued, RequestLease

    low.send(RequestLease(seq=2, priority=50, memory_bytes=100 * GIB))
    assert isinstance(low.recv(), Granted)
    high.send(RequestLease(seq=2, priority=250, memory_bytes=100 * GIB))
    assert isinstance(high.recv(), Queued)
    assert isinstance(high.recv(), Granted)


class RawClient:
    """One Unix-socket connection; send frames or raw bytes, read broker messages."""

    def __init__(self, path: str | Path, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.frames = FrameReader()

    def send(self, message: msgspec.Struct) -> None:
        self.sock.sendall(encode_frame(message))

    def send_body(self, body: bytes | dict) -> None:
        if isinstance(body, dict):
            body = encode_json(body)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0) -> BrokerMessage:
        deadline = time.monotonic() + timeout
        while True:
            body = self.frames.next_body()
            if body is not None:
                return decode_broker_message(body)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no message from the broker")
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.frames.feed(data)

    def recv_all(self, count: int, timeout: float = 5.0) -> list[BrokerMessage]:
        return [self.recv(timeout) for _ in range(count)]

    def is_closed_by_broker(self, timeout: float = 3.0) -> bool:
        """True when the broker closed its end (after any messages still buffered)."""
        try:
            while True:
                self.recv(timeout)
        except ConnectionError:
            return True
        except (TimeoutError, OSError):
            return False

    def hello(self, seq: int = 1, **fields) -> BrokerMessage:
        self.send(Hello(seq=seq, version=PROTOCOL_VERSION, pid=os.getpid(), **fields))
        return self.recv()

    def status(self, seq: int = 99) -> Snapshot:
        self.send(StatusRequest(seq=seq))
        while True:
            message = self.recv()
            if isinstance(message, StatusReply):
                return message.snapshot

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def visible_state(snapshot: Snapshot) -> tuple:
    """What a user would compare between two status calls (no clocks)."""
    return (
        [
            (
                lease.lease_id, lease.user, lease.state, lease.priority, lease.memory_bytes,
                lease.device_index, lease.position, lease.preemption_level,
            )
            for lease in snapshot.leases
        ],
        [(d.info.index, d.drained, d.memory_leased_mib, tuple(d.holders)) for d in snapshot.devices],
        snapshot.queue_by_priority,
    )  # fmt: skip


def status_of(path: str | Path) -> Snapshot:
    with BrokerClient(path, client="cli") as client:
        return client.status()


def start_holder(
    socket_path: str | Path, *, priority: int = 150, memory_gib: float = 8, instrumented=False
) -> tuple[subprocess.Popen, dict]:
    """A subprocess holding one lease; returns it and its first answer."""
    argv = [
        sys.executable, str(HOLDER), "--socket", str(socket_path),
        "--priority", str(priority), "--memory-gib", str(memory_gib),
    ]  # fmt: skip
    if instrumented:
        argv.append("--instrumented")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line:
        process.kill()
        raise AssertionError(f"lease holder failed: {process.stderr.read()}")  # type: ignore[union-attr]
    return process, json.loads(line)


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; return it (or the last value)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
