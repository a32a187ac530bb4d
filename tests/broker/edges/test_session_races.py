"""The runtime's session against notices that come faster than a cell looks.

A queued request may be granted and paused again in one breath (the broker answers
both at once); the cell must still start, paused, and never wait for a grant it
already has.  Driven through the real :class:`GpuSession` against a real broker.
"""

from __future__ import annotations

import threading
import time

from broker_wire import RawClient, wait_for

from gpushare_ext.protocol import Granted, Release, RequestLease, Welcome, encode_frame
from gpushare_ext.runtime.session import GpuSession, LeaseOptions

GIB = 1024**3


def test_a_request_granted_and_paused_at_once_still_starts_the_cell(broker):
    with RawClient(broker) as holder:
        assert isinstance(holder.hello(), Welcome)
        holder.send(RequestLease(seq=2, priority=150, memory_bytes=100 * GIB))
        held = holder.recv()
        assert isinstance(held, Granted)

        session = GpuSession(broker, notebook="race.ipynb")
        handles = []
        errors = []

        def acquire() -> None:
            try:
                handles.append(
                    session.acquire(LeaseOptions(priority=50, memory_bytes=60 * GIB, timeout_s=30))
                )
            except Exception as exc:
                errors.append(exc)

        thread = threading.Thread(target=acquire)
        thread.start()
        try:
            assert wait_for(lambda: session.leases, timeout=10), "the low request did not queue"
            [waiting] = session.leases.values()
            assert waiting.state == "queued"
            # The holder leaves and a high request arrives in the same read of the broker:
            # the low session gets "granted" and "paused" back to back, and takes both in
            # at once (as when its reconnect held the session for a moment).
            with session._lock:
                holder.sock.sendall(
                    encode_frame(Release(seq=3, lease_id=held.lease_id))
                    + encode_frame(RequestLease(seq=4, priority=250, memory_bytes=8 * GIB))
                )
                time.sleep(0.5)
            thread.join(timeout=10)
            assert not thread.is_alive(), "the cell kept waiting for a grant it had"
            assert errors == []
            [handle] = handles
            assert handle.placement is not None
            assert wait_for(lambda: handle.state == "paused"), handle.events
        finally:
            session.close()
            thread.join(timeout=5)
