"""The broker as a careless admin and a hostile client would meet it: every bad input is
answered, nothing is left half done, and what it says about itself is true.

A real broker subprocess on the simulated H200 in each test; clients are this process,
``nobody`` (as root) or raw sockets.
"""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import stat
import struct
import urllib.error
import urllib.request

import pytest
from broker_wire import RawClient, status_of, wait_for
from support import RunningBroker, free_port, is_root, run_as, short_tempdir

from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Granted,
    Hello,
    Ok,
    Refused,
    RequestLease,
    Welcome,
    encode_frame,
)

GIB = 1024**3
NON_ADMIN = "nobody" if is_root() else None


def test_hello_naming_another_pid_is_refused_and_the_connection_may_try_again(broker):
    with RawClient(broker) as raw:
        raw.send(Hello(seq=1, version=PROTOCOL_VERSION, pid=os.getpid() + 100_000))
        refused = raw.recv()
        assert isinstance(refused, Error) and refused.code == ErrorCode.PERMISSION
        assert f"the connecting process is pid {os.getpid()}" in refused.message

        assert isinstance(raw.hello(seq=2), Welcome)


def test_with_no_config_file_the_highest_priority_is_high_as_documented(broker):
    with BrokerClient(broker) as client:
        granted = client.request_lease(priority=299, memory_bytes=8 * GIB)
        assert isinstance(granted, Granted)
        assert granted.priority == 250
        assert granted.notice == "priority lowered from high (299) to high by policy"
        [view] = client.status().leases
        assert view.priority == 250


def test_garbage_costs_a_line_of_log_at_most_and_no_traceback(running_broker):
    bad_bodies = [
        b"[" * 987 + b"]" * 987,
        b'{"type":"request_lease","seq":3,"device":"\xc2\xb2"}',
        b'{"type":"' + b"y" * 100_000 + b'"}',
        b"\xff\xfe not json",
        b'{"type":"admin","seq":4,"action":"set_policy","policy_toml":"defaults = 5"}',
    ]
    before = running_broker.log.stat().st_size
    with RawClient(running_broker.socket) as raw:
        assert isinstance(raw.hello(), Welcome)
        for _ in range(20):
            for body in bad_bodies:
                raw.send_body(body)
                answer = raw.recv()
                assert isinstance(answer, Error | Refused), answer
                assert len(encode_frame(answer)) < 4096
        assert raw.status().you != ""
    log = running_broker.output()[before:]
    assert "Traceback" not in log
    assert len(log) < 20_000, log[-3000:]


def test_a_session_that_closes_before_its_preemption_runs_leaves_nothing_applied(running_broker):
    """Two low sessions of one process are paused together (their steps run one after the
    other); the second closes while the first is being stopped."""
    journal = running_broker.journal
    for _ in range(10):
        with RawClient(running_broker.socket) as first, RawClient(running_broker.socket) as second:
            for raw in (first, second):
                assert isinstance(raw.hello(), Welcome)
                raw.send(RequestLease(seq=2, priority=50, memory_bytes=8 * GIB))
                assert isinstance(raw.recv(), Granted)
            with RawClient(running_broker.socket) as high:
                assert isinstance(high.hello(), Welcome)
                high.send(RequestLease(seq=2, priority=250, memory_bytes=8 * GIB))
                second.sock.shutdown(socket.SHUT_RDWR)
                assert isinstance(high.recv(), Granted)
        assert wait_for(lambda: status_of(running_broker.socket).leases == [])

    def nothing_pending() -> bool:
        db = sqlite3.connect(journal)
        try:
            pending = db.execute("SELECT COUNT(*) FROM actuations WHERE undone_at IS NULL")
            return pending.fetchone()[0] == 0
        finally:
            db.close()

    assert wait_for(nothing_pending, timeout=5)
    log = running_broker.output()
    assert "mmap closed" not in log and "Traceback" not in log
    assert "never retrieved" not in log


# ------------------------------------------------------------------ policy changes


def _admin(socket_path, action: str, **kwargs) -> tuple[str, str]:
    with BrokerClient(socket_path, client="cli") as client:
        try:
            return "ok", client.admin(action, **kwargs)
        except BrokerError as exc:
            return exc.code.value, exc.message


@pytest.mark.parametrize(
    "text",
    [
        "defaults = 5\n",
        "groups = 3\n",
        'broker = "x"\n',
        "[groups]\nstudents = 4\n",
        "users = []\n",
        "[broker]\nmax_requests_per_second = nan\n",
        "[broker]\nadmin_groups = [1, 2]\n",
        "[defaults]\naging_per_minute = inf\n",
    ],
)
def test_a_bad_policy_sent_by_an_admin_gets_one_line_and_changes_nothing(broker, text):
    code, message = _admin(broker, "set_policy", policy_toml=text)
    assert code == ErrorCode.INVALID.value
    assert "\n" not in message
    assert _admin(broker, "drain", device=0) == ("ok", "device 0 drained")  # still serves
    _admin(broker, "undrain", device=0)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[broker]\ndevices = [99]\n", "none of the devices [99] exists here"),
        ('[broker]\nmetrics_token_file = "/nonexistent/token"\n', "No such file or directory"),
    ],
)
def test_a_policy_whose_restart_would_fail_is_refused_now(broker, text, names):
    """A setting only a restart applies is checked as the next start would check it: the
    admin hears now what would stop the broker, and nothing is changed."""
    code, message = _admin(broker, "set_policy", policy_toml=text)
    assert code == ErrorCode.INVALID.value, message
    assert names in message and "would stop the broker at its next start" in message
    assert "\n" not in message
    # Nothing was applied: a valid policy afterwards still names no pending restart.
    assert _admin(broker, "set_policy", policy_toml="[defaults]\nmax_leases = 3\n") == (
        "ok",
        "policy updated",
    )


def _my_admin_rights(socket_path) -> bool:
    with BrokerClient(socket_path) as client:
        return client.welcome.is_admin


def _heartbeats_until_limited(socket_path, count: int) -> int:
    with BrokerClient(socket_path) as client:
        for sent in range(count):
            try:
                client.heartbeat()
            except BrokerError:
                return sent
    return count


@pytest.mark.skipif(not is_root(), reason="needs a second user (nobody) on a system broker")
def test_broker_settings_of_a_new_policy_apply_at_once_and_the_rest_is_named(start_broker):
    running = start_broker(system=True, config_toml="[broker]\nmax_requests_per_second = 1000\n")
    assert run_as(NON_ADMIN, _my_admin_rights, running.socket) is False

    code, detail = _admin(
        running.socket,
        "set_policy",
        policy_toml=(
            '[broker]\nadmin_users = ["nobody"]\nmax_requests_per_second = 2\n'
            "metrics_port = 9999\nlock_timeout_ms = 100\n"
        ),
    )

    assert code == "ok"
    assert detail == "policy updated; restart the broker to apply broker.metrics_port"
    assert run_as(NON_ADMIN, _my_admin_rights, running.socket) is True
    # The new rate (a burst of two seconds' worth) holds for every user but root.
    assert run_as(NON_ADMIN, _heartbeats_until_limited, running.socket, 20) <= 6


def test_reload_policy_reads_the_file_the_broker_was_started_with(start_broker):
    running = start_broker(config_toml="[defaults]\nmax_leases = 1\n")
    with BrokerClient(running.socket) as client:
        assert isinstance(client.request_lease(priority=150, memory_bytes=GIB), Granted)
        refused = client.request_lease(priority=150, memory_bytes=GIB)
        assert isinstance(refused, Refused) and "1 lease(s)" in refused.message

        (running.directory / "broker.toml").write_text("[defaults]\nmax_leases = 3\n")
        assert _admin(running.socket, "reload_policy") == ("ok", "policy updated")

        assert isinstance(client.request_lease(priority=150, memory_bytes=GIB), Granted)


def test_reload_policy_without_a_config_file_says_what_to_do(broker):
    code, message = _admin(broker, "reload_policy")
    assert code == ErrorCode.INVALID.value
    assert "started without a config file" in message and "set-policy" in message


# ------------------------------------------------------------------ metrics


def _scrape(port: int, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_metrics_need_the_token_when_one_is_set_and_count_quota_refusals(start_broker, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-scrape-token\n")
    token_file.chmod(0o600)
    port = free_port()
    running = start_broker(
        config_toml=(
            f'[broker]\nmetrics_port = {port}\nmetrics_token_file = "{token_file}"\n'
            '[defaults]\nmemory_quota = "16GiB"\n'
        )
    )
    with BrokerClient(running.socket) as client:
        refused = client.request_lease(priority=150, memory_bytes=40 * GIB)
        assert isinstance(refused, Refused) and refused.code == ErrorCode.POLICY

    assert _scrape(port)[0] == 401
    assert _scrape(port, "wrong")[0] == 401
    status, text = wait_for(
        lambda: next(
            (r for r in [_scrape(port, "s3cret-scrape-token")] if 'code="policy"' in r[1]), None
        )
    )
    assert status == 200
    assert 'gpushare_refusals_total{code="policy"} 1.0' in text


def test_a_token_file_others_can_read_stops_the_broker_in_one_line(tmp_path):
    import subprocess
    import sys

    token_file = tmp_path / "token"
    token_file.write_text("abc\n")
    token_file.chmod(0o644)
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[broker]\nmetrics_port = {free_port()}\nmetrics_token_file = "{token_file}"\n'
    )
    result = subprocess.run(
        [
            sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200",
            "--socket", str(tmp_path / "b.sock"), "--journal", str(tmp_path / "j.sqlite"),
            "--config", str(config),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gpushare: ") and str(token_file) in last and "chmod 600" in last
    assert "Traceback" not in result.stderr


def test_a_socket_in_a_folder_that_does_not_exist_is_refused_and_nothing_is_made(tmp_path):
    import subprocess
    import sys

    socket_path = tmp_path / "no" / "such" / "b.sock"
    result = subprocess.run(
        [
            sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200",
            "--socket", str(socket_path), "--journal", str(tmp_path / "j.sqlite"),
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"gpushare: --socket {socket_path}: the folder {socket_path.parent} does not exist; "
        "create it first, or leave --socket out to use "
    )
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert list(tmp_path.iterdir()) == []  # neither the folders nor the journal


def test_a_socket_in_the_default_runtime_folder_still_makes_that_folder():
    xdg = short_tempdir("gps-xdg-")
    env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
    running = RunningBroker(xdg, socket_name="gpushare/broker.sock", env=env)
    try:
        running.start()
        assert status_of(running.socket).mode == "user"
        assert stat.S_IMODE((xdg / "gpushare").stat().st_mode) == 0o700
    finally:
        if running.process is not None and running.process.poll() is None:
            running.stop()
        shutil.rmtree(xdg, ignore_errors=True)


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_an_error_about_a_huge_unknown_type_still_answers_the_request(broker):
    with RawClient(broker) as raw:
        assert isinstance(raw.hello(), Welcome)
        raw.send_bytes(_frame(b'{"type":"' + b"z" * 262_000 + b'","seq":7}'))
        answer = raw.recv()
        assert isinstance(answer, Error) and answer.reply_to == 7
        raw.send_bytes(_frame(b'{"type":"heartbeat","seq":8}'))
        assert isinstance(raw.recv(), Ok)
