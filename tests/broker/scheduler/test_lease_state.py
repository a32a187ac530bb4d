"""One lease vocabulary: the state table, every side that moves a lease going by it, and
one request struct from the session to the core.

The core, the control block and the notebook runtime all use ``lease_state``; an illegal
move raises one error and changes nothing, wherever it is tried."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from scheduler_helpers import GIB, Hub

from gpushare_ext import lease_state
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import (
    ACTIVE,
    CONTROL_BLOCK_CODES,
    ENDED,
    MOVES,
    IllegalMove,
    LeaseState,
    check_move,
    state_told,
)
from gpushare_ext.protocol import (
    Capabilities,
    PreemptionLevel,
    decode_client_message,
    encode_frame,
)
from gpushare_ext.protocol import LeaseState as WireLeaseState
from gpushare_ext.runtime.leases import LeaseHandle, LeaseOptions

PACKAGE = Path(lease_state.__file__).resolve().parent


def test_the_protocol_speaks_of_the_same_states():
    assert WireLeaseState is LeaseState


def test_every_state_is_reachable_from_a_request_and_an_ended_lease_goes_nowhere():
    reached, frontier = {LeaseState.QUEUED}, [LeaseState.QUEUED]
    while frontier:
        for onward in MOVES[frontier.pop()] - reached:
            reached.add(onward)
            frontier.append(onward)
    assert reached == set(LeaseState)
    assert {LeaseState.RELEASED, LeaseState.REFUSED, LeaseState.REVOKED} == ENDED
    assert all(not MOVES[state] for state in ENDED)
    assert set(LeaseState) == ACTIVE | ENDED and not ACTIVE & ENDED


@pytest.mark.parametrize(
    ("current", "wanted"),
    [
        (LeaseState.RELEASED, LeaseState.RUNNING),  # a resume after the end
        (LeaseState.QUEUED, LeaseState.PAUSED),  # nothing to pause before a grant
        (LeaseState.EVICTED, LeaseState.PAUSED),  # an evicted lease comes back by resuming
        (LeaseState.RUNNING, LeaseState.REFUSED),  # refusals come before a grant
    ],
)
def test_an_illegal_move_is_named_in_one_line(current, wanted):
    with pytest.raises(IllegalMove) as raised:
        check_move("L7", current, wanted)
    message = str(raised.value)
    assert "\n" not in message and "L7" in message
    assert f"from {current.value} to {wanted.value}" in message
    assert raised.value.code == "illegal_move"


def test_the_core_refuses_an_illegal_move_and_changes_nothing():
    hub = Hub()
    ada = hub.open("ada")
    hub.request(ada, "L1", memory=8 * GIB)
    lease = hub.scheduler.leases["L1"]
    assert lease.state == LeaseState.RUNNING
    with pytest.raises(IllegalMove):
        transition(lease, hub.now, state=LeaseState.REFUSED, index=hub.scheduler.book.index)
    assert lease.state == LeaseState.RUNNING
    assert hub.scheduler.index_mismatch() == ""
    hub.release(ada, "L1")  # and it goes on as before
    assert "L1" not in hub.scheduler.leases


def _assignments_of_state(path: Path) -> list[str]:
    """The functions of ``path`` that assign ``<something>.state``."""
    tree = ast.parse(path.read_text())
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "state" for t in targets):
                found.append(function.name)
    return found


# The scheduler core's modules: only the transition function sets a lease's state.
CORE_MODULES = (
    "core",
    "admission",
    "gang_turns",
    "idle_parking",
    "lease_book",
    "lease_index",
    "lease_moves",
    "lease_transitions",
    "memory_seen",
    "placement",
    "queue_notices",
    "scheduler_records",
    "rivalry_watch",
    "scheduling_pass",
    "slot_finder",
)


def test_the_core_moves_a_lease_in_one_place_checked():
    places = [
        name
        for module in CORE_MODULES
        for name in _assignments_of_state(PACKAGE / "broker" / "scheduler" / f"{module}.py")
    ]
    assert places == ["transition"]
    source = (PACKAGE / "broker" / "scheduler" / "lease_transitions.py").read_text()
    body = source[source.index("def transition(") :]
    body = body[: body.index("lease.state = ")]
    assert "check_move(" in body and "check_stop(" in body, "the state is set before the checks"


def test_the_runtime_moves_its_handles_only_through_the_table():
    places = {
        path.name: found
        for path in sorted((PACKAGE / "runtime").rglob("*.py"))
        if (found := _assignments_of_state(path))
    }
    assert places == {"leases.py": ["move"]}


def test_a_notice_the_table_does_not_allow_is_ignored_and_noted():
    handle = LeaseHandle(lease_id="L3", options=LeaseOptions(), output=None)
    assert handle.move(LeaseState.RUNNING)
    assert handle.move(LeaseState.RELEASED)
    assert not handle.move(LeaseState.PAUSED)  # a pause that crossed the release
    assert handle.state == LeaseState.RELEASED
    assert "cannot go from released to paused" in handle.events[-1][1]


def test_the_control_block_carries_the_same_states(tmp_path):
    block = ControlBlock.create(tmp_path / "session.cb")
    try:
        assert block.state is None  # no lease yet
        for state in CONTROL_BLOCK_CODES:
            block.publish(gate_closed=False, state=state)
            assert block.state == state
            assert block.paused == (state in lease_state.STOPPED)
        block.publish(gate_closed=False, state=None)
        assert block.state is None
    finally:
        block.close()


def test_the_launch_shim_holds_launches_on_the_codes_of_a_stopped_lease():
    source = (PACKAGE / "runtime" / "native" / "launch_interpose.c").read_text()
    defined = dict(re.findall(r"#define STATE_(PAUSED|EVICTED) (\d+)", source))
    assert int(defined["PAUSED"]) == CONTROL_BLOCK_CODES[LeaseState.PAUSED]
    assert int(defined["EVICTED"]) == CONTROL_BLOCK_CODES[LeaseState.EVICTED]


def test_the_request_a_session_builds_reaches_the_core_as_it_was_sent():
    options = LeaseOptions(priority=250, memory_bytes=12 * GIB, device="0", sm_share=0.5)
    sent = options.request(Capabilities(lockable=False, yield_flag=True), "%%gpu priority=high")
    body = encode_frame(sent)[4:]  # what the broker reads off the socket, less the length
    received = decode_client_message(body)
    assert received == sent

    hub = Hub()
    session = hub.open("ada")
    hub.handle(
        core.LeaseRequested(now=hub.now, session_id=session, lease_id="L1", request=received)
    )
    lease = hub.scheduler.leases["L1"]
    assert (lease.base_priority, lease.memory_bytes, lease.sm_share, lease.device_wish) == (
        250,
        12 * GIB,
        0.5,
        "0",
    )
    assert lease.label == "%%gpu priority=high" and not lease.lockable


def test_the_state_a_pause_notice_tells_moves_the_kernels_handle_by_its_table():
    """The core words the state (``state_told``); the kernel's handle takes it as it is."""
    for level in PreemptionLevel:
        handle = LeaseHandle(lease_id="L4", options=LeaseOptions(), output=None)
        handle.move(LeaseState.RUNNING)
        assert handle.move(state_told(LeaseState.RUNNING, level)), (level, handle.events)
        assert handle.state == LeaseState.PAUSED  # evicted only once it was paused
        assert handle.move(state_told(LeaseState.PAUSED, PreemptionLevel.EVICT))
        assert handle.state == LeaseState.EVICTED
