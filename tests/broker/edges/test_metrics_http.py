"""The metrics endpoint as a scraper meets it: open without a token, 401 for a missing
or wrong bearer token, the counters in the body, IPv6, and a port that closes; and the
token file an admin writes, refused when it is not a private, single-token file."""

from __future__ import annotations

import os
import pwd
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import free_port, short_tempdir

from gpushare_ext.broker.edges.metrics import BrokerMetrics, read_token_file
from gpushare_ext.broker.settings.policy import PolicyError

TOKEN = "s3cret-scrape-token"
# No proxy: an http_proxy in the environment must not carry loopback requests away.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch(url: str, authorization: str | None = None) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with OPENER.open(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers), error.read().decode()


@pytest.fixture
def metrics() -> Iterator[BrokerMetrics]:
    served = BrokerMetrics()
    served.observe_refusal("policy")
    served.observe_refusal("policy")
    served.observe_refusal("too_large")
    served.observe_priority_lowered()
    yield served
    served.close()


def test_without_a_token_anyone_on_loopback_reads_the_counters(metrics):
    port = free_port("127.0.0.1")
    metrics.serve(port)

    status, _, body = fetch(f"http://127.0.0.1:{port}/metrics")

    assert status == 200
    assert 'gpushare_refusals_total{code="policy"} 2.0' in body
    assert 'gpushare_refusals_total{code="too_large"} 1.0' in body
    assert "gpushare_priority_lowered_total 1.0" in body


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer "],
    ids=["no-header", "wrong", "longer", "basic-scheme", "no-scheme", "empty"],
)
def test_with_a_token_a_request_without_it_gets_401_and_no_metrics(metrics, authorization):
    port = free_port("127.0.0.1")
    metrics.serve(port, "127.0.0.1", token=TOKEN)

    status, headers, body = fetch(f"http://127.0.0.1:{port}/metrics", authorization)

    assert status == 401
    assert headers.get("WWW-Authenticate", "").startswith("Bearer")
    assert "gpushare_" not in body and body.strip()


def test_with_a_token_the_right_bearer_gets_the_metrics(metrics):
    port = free_port("127.0.0.1")
    metrics.serve(port, "127.0.0.1", token=TOKEN)

    status, _, body = fetch(f"http://127.0.0.1:{port}/metrics", f"Bearer {TOKEN}")

    assert status == 200
    assert "gpushare_refusals" in body
    assert 'gpushare_refusals_total{code="policy"} 2.0' in body


def test_close_stops_serving_and_frees_the_port(metrics):
    port = free_port("127.0.0.1")
    metrics.serve(port, token=TOKEN)
    assert fetch(f"http://127.0.0.1:{port}/", f"Bearer {TOKEN}")[0] == 200

    metrics.close()

    with pytest.raises(urllib.error.URLError):
        fetch(f"http://127.0.0.1:{port}/", f"Bearer {TOKEN}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        # As a restarted broker would: the closed connection may linger in TIME_WAIT,
        # but nothing listens there any more.
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen(1)


def test_an_empty_token_is_refused_rather_than_letting_everyone_in(metrics):
    with pytest.raises(ValueError):
        metrics.serve(free_port("127.0.0.1"), token="")


def ipv6_loopback_port() -> int:
    if not socket.has_ipv6:
        pytest.skip("Python was built without IPv6")
    try:
        return free_port("::1", socket.AF_INET6)
    except OSError as error:
        pytest.skip(f"this host has no IPv6 loopback ({error.strerror})")


def test_an_ipv6_address_is_served(metrics):
    port = ipv6_loopback_port()
    metrics.serve(port, "::1", token=TOKEN)

    assert fetch(f"http://[::1]:{port}/metrics")[0] == 401
    status, _, body = fetch(f"http://[::1]:{port}/metrics", f"Bearer {TOKEN}")

    assert status == 200 and "gpushare_refusals" in body


# ------------------------------------------------------------------ the token file


def token_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "metrics.token"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_a_private_token_file_is_read_and_stripped(tmp_path):
    assert read_token_file(token_file(tmp_path, b"  s3cret-scrape-token\n")) == TOKEN
    assert read_token_file(str(token_file(tmp_path, TOKEN.encode(), 0o400))) == TOKEN


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o610, 0o602])
def test_a_token_file_open_to_others_is_refused(tmp_path, mode):
    path = token_file(tmp_path, TOKEN.encode(), mode)
    with pytest.raises(PolicyError) as raised:
        read_token_file(path)
    message = str(raised.value)
    assert str(path) in message and f"{mode:04o}" in message and "chmod 600" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "is empty"),
        (b" \n\t\n", "is empty"),
        (b"one two\n", "one token"),
        (b"line-one\nline-two\n", "one token"),
        ("tök".encode(), "one token"),
        (b"x" * 5000, "over 4096 bytes"),
    ],
)
def test_a_token_file_that_holds_no_single_token_is_refused(tmp_path, content, words):
    path = token_file(tmp_path, content)
    with pytest.raises(PolicyError) as raised:
        read_token_file(path)
    assert str(path) in str(raised.value) and words in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_missing_token_file_is_named(tmp_path):
    with pytest.raises(PolicyError) as raised:
        read_token_file(tmp_path / "absent.token")
    assert str(raised.value) == (
        f"metrics token file {tmp_path / 'absent.token'}: No such file or directory"
    )


def test_a_token_file_another_user_owns_is_refused(tmp_path, two_users):
    """0600 but another user's: that user knows the token the root broker would use."""
    _, other = two_users
    path = token_file(tmp_path, TOKEN.encode())
    os.chown(path, pwd.getpwnam(other).pw_uid, -1)
    with pytest.raises(PolicyError) as raised:
        read_token_file(path)
    message = str(raised.value)
    assert str(path) in message and other in message and "\n" not in message


def test_a_link_to_a_token_file_is_refused(tmp_path):
    """Another user's link to a file of theirs (or to the real one): never followed."""
    target = token_file(tmp_path, TOKEN.encode())
    link = tmp_path / "link.token"
    link.symlink_to(target)
    with pytest.raises(PolicyError) as raised:
        read_token_file(link)
    assert str(raised.value) == (
        f"metrics token file {link} is a symbolic link; name the file itself"
    )


def test_a_broker_that_cannot_serve_metrics_leaves_nothing_behind(tmp_path):
    """It exits 1 with the reason, and neither its socket (a system broker's is open to
    every user) nor its sessions directory under /dev/shm stays."""
    import subprocess
    import sys

    from gpushare_ext.paths import SHM_DIR, sessions_prefix_for

    token = token_file(tmp_path, TOKEN.encode(), 0o644)
    directory = short_tempdir()
    socket_path = directory / "broker.sock"
    config = directory / "broker.toml"
    config.write_text(
        f'[broker]\nmetrics_port = {free_port("127.0.0.1")}\nmetrics_token_file = "{token}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200",
         "--socket", str(socket_path), "--journal", str(directory / "journal.sqlite"),
         "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "open to group or others" in done.stderr
    assert not socket_path.exists()
    leftovers = list(SHM_DIR.glob(sessions_prefix_for(socket_path) + "*"))
    assert leftovers == []
