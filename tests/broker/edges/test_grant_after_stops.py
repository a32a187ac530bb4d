"""A grant that pauses another session waits, bounded, until that session has stopped.

The paused session's last kernels would otherwise share the GPU with the new lease's
first ones.  On the simulated GPU each lock takes ``lock_drain_ms`` (as a real lock waits
for the locked process's queued work), so the test can see when the grant leaves.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from broker_wire import RawClient

from gpushare_ext.broker.edges.context import Outbox
from gpushare_ext.broker.hands.inventory import fixture_path
from gpushare_ext.protocol import Granted, Preempt, RequestLease

GIB = 1024**3


def _draining_inventory(directory: Path, drain_ms: int) -> Path:
    document = json.loads(fixture_path("h200").read_text())
    document["lock_drain_ms"] = drain_ms
    path = directory / f"h200-drain-{drain_ms}.json"
    path.write_text(json.dumps(document))
    return path


def _time_to_grant(start_broker, tmp_path: Path, drain_ms: int, bound_ms: int) -> tuple:
    """Seconds from the high request to its grant, and what the low session heard."""
    running = start_broker(
        simulate=str(_draining_inventory(tmp_path, drain_ms)),
        config_toml=f"[broker]\ngrant_after_stops_ms = {bound_ms}\n",
    )
    with RawClient(running.socket) as low, RawClient(running.socket, timeout=15) as high:
        low.hello()
        high.hello()
        low.send(RequestLease(seq=2, priority=50, memory_bytes=10 * GIB))
        assert isinstance(low.recv(), Granted)
        asked = time.monotonic()
        high.send(RequestLease(seq=2, priority=250, memory_bytes=10 * GIB))
        answer = high.recv(timeout=15)
        waited = time.monotonic() - asked
        assert isinstance(answer, Granted), answer
        heard = low.recv(timeout=15)
        return waited, heard, running.output()


def test_the_grant_leaves_once_the_paused_session_has_stopped(start_broker, tmp_path):
    waited, heard, _ = _time_to_grant(start_broker, tmp_path, drain_ms=700, bound_ms=10_000)
    assert isinstance(heard, Preempt)
    assert waited >= 0.6, f"granted {waited:.3f} s after asking, before the 0.7 s lock ended"
    assert waited < 5, waited


def test_a_stop_that_takes_longer_than_the_bound_does_not_hold_the_grant(start_broker, tmp_path):
    waited, heard, log = _time_to_grant(start_broker, tmp_path, drain_ms=4000, bound_ms=100)
    assert isinstance(heard, Preempt)
    assert 0.08 <= waited < 3, f"granted {waited:.3f} s after asking (bound 0.1 s, lock 4 s)"
    assert "granted before the sessions it pauses had stopped (after 100 ms)" in log


def test_a_bound_of_zero_grants_at_once(start_broker, tmp_path):
    waited, heard, _ = _time_to_grant(start_broker, tmp_path, drain_ms=3000, bound_ms=0)
    assert isinstance(heard, Preempt)
    assert waited < 2.5, f"granted {waited:.3f} s after asking, with no wait allowed"


class _Conn:
    """Stands for a connection: the outbox only uses it as a key."""


def test_what_is_put_while_a_message_is_reserved_waits_behind_it():
    written: list[tuple[object, str]] = []
    outbox = Outbox()
    outbox.attach(lambda conn, message: written.append((conn, message)))  # type: ignore[arg-type,misc]
    one, other = _Conn(), _Conn()
    outbox.put(one, "before")  # type: ignore[arg-type]
    first = outbox.reserve(one)  # type: ignore[arg-type]
    second = outbox.reserve(one)  # type: ignore[arg-type]
    outbox.put(one, "after")  # type: ignore[arg-type]
    outbox.put(other, "elsewhere")  # type: ignore[arg-type]
    assert written == [(one, "before"), (other, "elsewhere")]
    outbox.fill(one, second, "second")  # type: ignore[arg-type]
    assert written == [(one, "before"), (other, "elsewhere")]  # the first still waits
    outbox.fill(one, first, "first")  # type: ignore[arg-type]
    assert written[2:] == [(one, "first"), (one, "second"), (one, "after")]
    outbox.put(one, "later")  # type: ignore[arg-type]
    assert written[-1] == (one, "later")  # nothing is held any more
