"""Two real Unix users on one system broker: neither can touch, or see into, the other's work,
nor send anything but plain text to the other's (or root's) ``gpushare status``.

The broker runs as root in system mode on a socket in a world-accessible directory;
each user's client is a forked child that dropped to that user with setgid/setuid.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shutil
import struct
import subprocess
import sys
import termios
import tty
import unicodedata

import pytest
from broker_wire import status_of, wait_for
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


# ------------------------------------------------------------------ text one user writes

# What a session may write: a label that clears the screen, sets the terminal's title
# and draws a fake row of root's table; a note that was rich markup (a closing tag that
# made `gpushare status` exit 1, a hyperlink and bold red text) with a bidi override.
HOSTILE_LABEL = (
    "\x1b[2J\x1b[H\x1b]0;owned\x07FAKE\nL7   root   high   running   GPU 0   140 GiB [/]"
)
HOSTILE_NOTE = (
    "[link=https://example.invalid/x]details[/link] [bold red]ADMIN NOTICE: run "
    "\u202ehs.tpircs[/bold red] [/]"
)
SGR = re.compile(rb"\x1b\[[0-9;]*m")  # the colours and weights status itself uses


def _hold_a_lease_saying(channel, socket_path, note: str) -> None:
    """A user's low-priority lease labelled ``HOSTILE_LABEL``, whose session writes
    ``note`` into its control block (as its runtime writes what its kernels got)."""
    from gpushare_ext.control_block import ControlBlock

    with BrokerClient(socket_path, notebook="[/]\x1b[31mthesis.ipynb") as client:
        lease = client.request_lease(priority=50, label=HOSTILE_LABEL)
        assert isinstance(lease, Granted), lease
        if note:
            block = ControlBlock.open(client.welcome.control_block)
            block.write_session_note(note)
            block.close()
        channel.send(lease.lease_id)
        channel.recv()


def _take_the_gpu(channel, socket_path) -> None:
    """Another user's high-priority lease, labelled as hostilely: it pauses the first."""
    with BrokerClient(socket_path) as client:
        lease = client.request_lease(priority=250, label=HOSTILE_LABEL)
        assert isinstance(lease, Granted), lease
        channel.send(lease.lease_id)
        channel.recv()


def _status_as(user: str | None, socket_path, columns: int, *, terminal: bool) -> tuple[int, bytes]:
    """``gpushare status`` as ``user`` runs it (None: root), on a colour terminal of
    ``columns`` (a pseudo-terminal: rich sees a tty) or into a pipe; (status, output)."""
    command = [sys.executable, "-m", "gpushare_ext.cli", "status", "--socket", str(socket_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM")}
    env.update(TERM="xterm-256color", COLUMNS=str(columns), LINES="50")
    who = {}
    if user is not None:
        entry = pwd.getpwnam(user)
        who = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    if not terminal:
        done = subprocess.run(command, capture_output=True, env=env, timeout=60, **who)
        return done.returncode, done.stdout + done.stderr
    leader, follower = os.openpty()
    tty.setraw(follower)  # bytes as the program wrote them: no CR added before each LF
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    process = subprocess.Popen(command, stdout=follower, stderr=follower, env=env, **who)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the program closed its end of the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    return process.wait(timeout=60), output


def _lease_rows(text: str) -> list[str]:
    """The lease id in each row of the leases table (lines of a row wrapped inside a
    cell leave the first cell empty)."""
    _, _, after_title = text.partition("leases and queue")
    table, _, _ = after_title.partition("\n└")
    return re.findall(r"^│ (\S+) ", table, flags=re.MULTILINE)


def _assert_shows_only_text(output: bytes, *, colours: bool) -> str:
    """Only the view's own line breaks (and colours on a terminal) are not text: no
    escape sequence, control character, bidi control or line separator came through."""
    text = (SGR.sub(b"", output) if colours else output).decode()
    assert "\x1b" not in text, ascii(text)
    hidden = {"Cc", "Cf", "Zl", "Zp"}
    assert all(c == "\n" or unicodedata.category(c) not in hidden for c in text), ascii(text)
    return text


def test_a_users_label_and_note_reach_other_users_and_root_as_plain_text(
    two_users, start_broker, forked_users
):
    user_a, user_b = two_users
    running = start_broker(system=True)
    a = forked_users(user_a, _hold_a_lease_saying, running.socket, HOSTILE_NOTE)
    paused_id = a.recv()
    b = forked_users(user_b, _take_the_gpu, running.socket)
    running_id = b.recv()
    said = wait_for(
        lambda: next(
            (
                v
                for v in status_of(running.socket).leases
                if v.lease_id == paused_id and "the session says" in v.reason
            ),
            None,
        )
    )
    assert said is not None and said.state.value == "paused", status_of(running.socket)

    # Another user (who sees its own label), root (every label), the writer itself (its
    # reason; the other's label is not its to see).
    for user, why in ((user_b, [paused_id, running_id]), (None, [paused_id, running_id]),
                      (user_a, [paused_id])):  # fmt: skip
        status, output = _status_as(user, running.socket, 80, terminal=True)
        assert status == 0, output.decode(errors="replace")
        assert SGR.search(output), "no colours: the command did not see a terminal"
        text = _assert_shows_only_text(output, colours=True)
        assert _lease_rows(text) == [paused_id, running_id], text
        # Below the table at 80 columns: one line a lease, cut at the edge; the label's
        # line break is a "␤" in it, so its fake row starts no line.
        reasons = [line for line in text.splitlines() if re.match(r"L\d+: ", line)]
        assert [line.split(":")[0] for line in reasons] == why, text
        assert all(len(line) <= 80 for line in reasons), text
        assert not re.search(r"^(FAKE|L7 )", text, flags=re.MULTILINE), text

        status, output = _status_as(user, running.socket, 400, terminal=False)
        assert status == 0, output.decode(errors="replace")
        text = _assert_shows_only_text(output, colours=False)
        assert _lease_rows(text) == [paused_id, running_id], text
        # The note, whole and as typed, is the session's word in the paused lease's row.
        assert "the session says: [link=https://example.invalid/x]details[/link] [bold red]" in text
        assert "<U+202E>hs.tpircs[/bold red] [/]" in text

    a.send("done")
    b.send("done")
