"""The broker's log lets an admin follow every lease: grants, pauses, refusals, ends."""

from __future__ import annotations

import re

from broker_wire import RawClient, evict_low_for_high, wait_for

from gpushare_ext.protocol import Refused, Release, Released, RequestLease

GIB = 1024**3


def lease_lines(running_broker) -> list[str]:
    return [
        line.split(" gpushare.broker.leases INFO ", 1)[1]
        for line in running_broker.output().splitlines()
        if " gpushare.broker.leases INFO " in line
    ]


def test_each_lease_event_is_one_line_in_the_broker_log(running_broker):
    with RawClient(running_broker.socket) as low, RawClient(running_broker.socket) as high:
        low.hello()
        high.hello()
        evict_low_for_high(low, high)
        high.send(RequestLease(seq=3, priority=150, memory_bytes=900 * GIB))
        assert isinstance(high.recv(), Refused)
        low.send(Release(seq=3, lease_id="L1"))
        assert any(isinstance(m, Released) for m in low.recv_all(2))  # after its Preempt
        assert wait_for(lambda: len(lease_lines(running_broker)) >= 6, timeout=5)

    pid = r"\(pid \d+\)"
    # How long the stop took comes when the ladder step returns, in any order with the
    # grant: one line of its own, in the rung that holds it.
    stops = [line for line in lease_lines(running_broker) if " stopped at level " in line]
    assert len(stops) == 1 and re.fullmatch(
        rf"L1 {pid} stopped at level 0 \(gate\) in \d+\.\d ms", stops[0]
    ), stops
    lines = [line for line in lease_lines(running_broker) if line not in stops]
    assert re.fullmatch(
        rf"L1 granted to \w+ {pid} on GPU 0: 100 GiB, priority 50, after 0\.\d s", lines[0]
    ), lines
    assert re.fullmatch(
        # The rung that holds it, as the cell and status say (a simulated GPU's gate), and
        # the level asked beside it.
        rf"L1 {pid} evicted at level 0 \(gate\) for L2; level 4 asked, which only the gate "
        r"holds on a simulated GPU: paused for a higher-priority session \(high lease L2\)",
        lines[1],
    ), lines
    assert re.fullmatch(rf"L2 granted to \w+ {pid} on GPU 0: 100 GiB, priority 250, .*", lines[2])
    assert lines[3] == (
        "L3 refused (invalid): 900 GiB does not fit any matching device or slice "
        "(the largest has 140 GiB)"
    )
    assert re.fullmatch(rf"L1 {pid} ended after \d+\.\d s: released", lines[4]), lines
