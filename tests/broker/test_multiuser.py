"""Two real Unix users on one system broker: neither can touch, or see into, the other's work.

The broker runs as root in system mode on a socket in a world-accessible directory;
each user's client is a forked child that dropped to that user with setgid/setuid.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil

import pytest
from broker_wire import status_of
from support import is_root, launch_broker, run_as

from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.control_block import ControlBlock, ControlBlockError
from gpushare_ext.protocol import ErrorCode, Granted

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(not is_root(), reason="creates Unix users and drops to them: needs root"),
]


@pytest.fixture(scope="module")
def system_broker():
    running = launch_broker(system=True)
    yield running
    running.stop()
    shutil.rmtree(running.directory, ignore_errors=True)


def _hold_a_lease(channel, socket_path) -> None:
    """User A: take a lease, report it, then wait to be told the test is over."""
    with BrokerClient(socket_path, notebook="thesis/secret.ipynb") as client:
        lease = client.request_lease(priority=150, label="%%gpu secret-cell")
        assert isinstance(lease, Granted), lease
        path = client.welcome.control_block
        block = ControlBlock.open(path)  # A can open its own control block
        block.close()
        channel.send({"lease_id": lease.lease_id, "control_block": path, "pid": os.getpid()})
        channel.recv()  # B does its worst meanwhile
        mine = [x for x in client.status().leases if x.lease_id == lease.lease_id]
        channel.send({"state": mine[0].state.value if mine else "gone", "user": mine[0].user})


def _code_of(call) -> str:
    try:
        call()
    except BrokerError as exc:
        return exc.code.value
    return "allowed"


def _try_everything_on(socket_path, lease_id: str, control_block: str) -> dict:
    """User B: try to release, inspect, control and open user A's session."""
    result: dict = {}
    with BrokerClient(socket_path, notebook="b.ipynb") as client:
        result["release"] = _code_of(lambda: client.release(lease_id))
        result["drain"] = _code_of(lambda: client.admin("drain", device=0))
        result["cancel"] = _code_of(lambda: client.admin("cancel", lease_id=lease_id))
        result["yield_flag"] = _code_of(lambda: client.register_yield_flag(lease_id, 0, "00"))
        view = next(x for x in client.status().leases if x.lease_id == lease_id)
        result["view"] = {
            "user": view.user, "own": view.own, "pid": view.pid, "label": view.label,
            "notebook": view.notebook,
        }  # fmt: skip
        result["is_admin"] = client.welcome.is_admin
    try:
        with open(control_block, "rb"):
            result["open"] = "opened"
    except PermissionError:
        result["open"] = "PermissionError"
    try:
        ControlBlock.open(control_block).close()
        result["control_block"] = "opened"
    except ControlBlockError as exc:
        result["control_block"] = str(exc)
    return result


def test_a_user_cannot_touch_or_see_into_another_users_session(
    two_users, system_broker, forked_users
):
    user_a, user_b = two_users
    a = forked_users(user_a, _hold_a_lease, system_broker.socket)
    held = a.recv()

    seen_by_b = run_as(
        user_b, _try_everything_on, system_broker.socket, held["lease_id"], held["control_block"]
    )

    assert seen_by_b["is_admin"] is False
    assert seen_by_b["release"] == ErrorCode.PERMISSION.value
    assert seen_by_b["drain"] == ErrorCode.PERMISSION.value
    assert seen_by_b["cancel"] == ErrorCode.PERMISSION.value
    # Registering a flag on someone else's lease: "not yours or not active".
    assert seen_by_b["yield_flag"] in (ErrorCode.PERMISSION.value, ErrorCode.UNKNOWN_LEASE.value)
    view = seen_by_b["view"]
    assert re.fullmatch(r"user-[0-9a-f]{4}", view["user"]), view
    assert view == {**view, "own": False, "pid": None, "label": "", "notebook": ""}
    assert seen_by_b["open"] == "PermissionError"
    assert "is not yours" in seen_by_b["control_block"]

    a.send("done")
    after = a.recv()
    assert after == {"state": "running", "user": user_a}


def test_an_admin_sees_everyone_by_name(two_users, system_broker, forked_users):
    user_a, _ = two_users
    a = forked_users(user_a, _hold_a_lease, system_broker.socket)
    held = a.recv()

    lease = next(
        x for x in status_of(system_broker.socket).leases if x.lease_id == held["lease_id"]
    )

    assert (lease.user, lease.pid, lease.label) == (user_a, held["pid"], "%%gpu secret-cell")
    assert lease.notebook == "thesis/secret.ipynb"
    a.send("done")
    a.recv()


def test_control_blocks_belong_to_their_user_with_mode_0600(two_users, system_broker, forked_users):
    user_a, _ = two_users
    a = forked_users(user_a, _hold_a_lease, system_broker.socket)
    held = a.recv()

    info = os.stat(held["control_block"])

    assert info.st_uid == pwd.getpwnam(user_a).pw_uid
    assert info.st_mode & 0o777 == 0o600
    assert os.stat(system_broker.socket).st_mode & 0o777 == 0o666
    a.send("done")
    a.recv()


def _idle_session(channel, socket_path) -> None:
    """User A: a notebook session that ran a cell and now sits idle."""
    with BrokerClient(socket_path, notebook="idle.ipynb") as client:
        lease = client.request_lease(priority=150, label="%%gpu done")
        client.release(lease.lease_id)
        channel.send(os.getpid())
        channel.recv()


def _park(socket_path, pid: int) -> str:
    with BrokerClient(socket_path, client="cli") as client:
        try:
            return client.park(pid)
        except BrokerError as exc:
            return f"{exc.code.value}: {exc.message}"


def test_a_user_cannot_park_another_users_notebook(two_users, system_broker, forked_users):
    user_a, user_b = two_users
    a = forked_users(user_a, _idle_session, system_broker.socket)
    pid = a.recv()

    refused = run_as(user_b, _park, system_broker.socket, pid)

    assert refused == (
        f"{ErrorCode.PERMISSION.value}: pid {pid} is another user's notebook; "
        "only an admin may park it"
    )
    a.send("done")
