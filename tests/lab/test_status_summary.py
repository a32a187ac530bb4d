"""The status bar's one line (``statusSummary`` in ``gpushare_ext/widgets/occupancy.js``,
which the JupyterLab panel imports), run by Node on snapshots as the broker words them.

A viewer whose only request waits reads where it stands ("GPU: queued, position 1"),
not "GPU: queued, 1 queued", which counted the viewer's own request as someone else's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from gpushare_ext.protocol import LeaseState, LeaseView

WIDGET = Path(__file__).resolve().parents[2] / "gpushare_ext" / "widgets" / "occupancy.js"
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")


def lease(lease_id: str, state: LeaseState, *, own: bool, position: int | None = None,
          gang: str = "") -> LeaseView:  # fmt: skip
    return LeaseView(
        lease_id=lease_id, user="me" if own else "user-3f2a", own=own, priority=100,
        state=state, device_index=None if state == LeaseState.QUEUED else 0, mig_uuid=None,
        memory_bytes=8 << 30, sm_share=1.0, since_s=3.0, waited_s=0.0, position=position,
        gang=gang,
    )  # fmt: skip


def status_bar(*leases: LeaseView) -> str:
    """What the status bar reads for a snapshot holding ``leases``."""
    snapshot = json.loads(msgspec.json.encode({"leases": list(leases)}))
    script = (
        f"import {{ statusSummary }} from {json.dumps(WIDGET.as_uri())};\n"
        f"process.stdout.write(statusSummary({json.dumps(snapshot)}));\n"
    )
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


RUNNING, QUEUED, PAUSED = LeaseState.RUNNING, LeaseState.QUEUED, LeaseState.PAUSED


def test_a_viewer_who_only_waits_reads_its_place_in_the_queue():
    holder = lease("L1", RUNNING, own=False)
    assert status_bar(holder, lease("L2", QUEUED, own=True, position=1)) == (
        "GPU: queued, position 1"
    )
    others = lease("L3", QUEUED, own=False, position=1)
    assert status_bar(holder, others, lease("L4", QUEUED, own=True, position=2)) == (
        "GPU: queued, position 2 of 2"
    )


def test_a_queued_gang_is_one_request_with_one_place():
    ranks = [lease(f"L5.{n}", QUEUED, own=True, position=1, gang="L5") for n in range(3)]
    assert status_bar(lease("L1", RUNNING, own=False), *ranks) == "GPU: queued, position 1"


def test_a_viewer_holding_a_gpu_reads_its_state_and_how_many_wait():
    waiting = lease("L2", QUEUED, own=False, position=1)
    assert status_bar(lease("L1", RUNNING, own=True), waiting) == "GPU: running, 1 queued"
    assert status_bar(lease("L1", PAUSED, own=True)) == "GPU: paused"
    assert status_bar(lease("L1", RUNNING, own=False), waiting) == "GPU: busy, 1 queued"
    assert status_bar() == "GPU: idle"
