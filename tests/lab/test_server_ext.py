"""The server extension as the JupyterLab panel uses it: REST, stream and admin over HTTP.

Runs a real jupyter_server (pytest-jupyter) with the extension enabled the way an install
enables it, against a real broker on the simulated H200.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tornado.httpclient import HTTPClientError

from gpushare_ext.protocol import PRIORITY_CLASSES

HIGH = PRIORITY_CLASSES["high"]
LOW = PRIORITY_CLASSES["low"]


@pytest.fixture
def jp_server_config(running_broker) -> dict:
    return {
        "ServerApp": {"jpserver_extensions": {"gpushare_ext": True}},
        "GpushareServerExtension": {"socket_path": str(running_broker.socket)},
    }


def cli_status_json(socket_path: Path) -> dict:
    """What ``gpushare status --json`` prints."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare_ext.cli",
            "status",
            "--json",
            "--socket",
            str(socket_path),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return json.loads(out.stdout)


def lease_rows(snapshot: dict) -> list[tuple]:
    return sorted(
        (lease["lease_id"], lease["user"], lease["state"], lease["priority"], lease["position"])
        for lease in snapshot["leases"]
    )


async def get_json(jp_fetch, *path: str, params: dict | None = None) -> dict:
    response = await jp_fetch("gpushare", *path, params=params)
    assert response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.body)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "snapshot", None),
        ("GET", "stream", None),
        ("GET", "history", None),
        ("POST", "admin", json.dumps({"action": "drain", "device": 0})),
    ],
)
async def test_requests_without_a_token_are_refused(jp_fetch, sessions, method, path, body):
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("gpushare", path, method=method, body=body, headers={"Authorization": ""})
    assert refused.value.code in (401, 403)
    assert not sessions().status().devices[0].drained


async def test_snapshot_matches_gpushare_status_json(jp_fetch, running_broker, sessions):
    high, low = sessions(), sessions()
    high.request_lease(priority=HIGH, label="explore")
    low.request_lease(priority=LOW, label="train")

    snapshot = await get_json(jp_fetch, "snapshot")
    status = cli_status_json(running_broker.socket)

    assert [d["info"] for d in snapshot["devices"]] == [d["info"] for d in status["devices"]]
    assert snapshot["devices"][0]["info"]["name"] == "NVIDIA H200"
    assert len(snapshot["devices"][0]["info"]["profiles"]) == 7
    assert [d["holders"] for d in snapshot["devices"]] == [d["holders"] for d in status["devices"]]
    assert lease_rows(snapshot) == lease_rows(status)
    states = {lease["priority"]: lease["state"] for lease in snapshot["leases"]}
    assert states == {HIGH: "running", LOW: "queued"}
    assert (snapshot["node"], snapshot["you"]) == (status["node"], status["you"])


async def test_no_broker_is_a_503_with_a_clear_message(jp_fetch, running_broker):
    running_broker.stop()
    for path in ("snapshot", "stream"):
        with pytest.raises(HTTPClientError) as unavailable:
            await jp_fetch("gpushare", path)
        assert unavailable.value.code == 503
        body = json.loads(unavailable.value.response.body)
        assert body["error"] == "unavailable"
        assert body["message"].startswith("No GPU broker reachable at ")
        assert str(running_broker.socket) in body["message"]
        # A user's own socket: the first %%gpu cell starts a broker, and the panel
        # follows it without a reload.
        assert "The first `%%gpu` cell of a notebook starts one for you" in body["message"]
        assert "reload" not in body["message"]


def test_on_the_system_socket_the_message_sends_the_user_to_the_admin():
    from gpushare_ext.paths import SYSTEM_SOCKET
    from gpushare_ext.server_ext.handlers import no_broker_message

    message = no_broker_message(SYSTEM_SOCKET, "connection refused")
    assert "The admin starts the system broker" in message and "%%gpu" not in message


def open_sockets(pid: int) -> int:
    """How many sockets the process ``pid`` holds open (its listening one included)."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


async def test_the_stream_renews_its_broker_connection_and_goes_on(
    jp_fetch, running_broker, monkeypatch
):
    # The broker learns who the user is (an admin or not) when a connection opens: the
    # stream moves to a new one every IDENTITY_RENEWAL_S (test_admin_flag.py: what the
    # user sees of it), here every half second, without a gap or a connection left open.
    from gpushare_ext.server_ext import handlers

    monkeypatch.setattr(handlers, "IDENTITY_RENEWAL_S", 0.5)
    pid = running_broker.process.pid
    before = open_sockets(pid)
    arrivals: list[tuple[float, bytes]] = []

    def on_chunk(chunk: bytes) -> None:
        arrivals.append((asyncio.get_running_loop().time(), chunk))

    stream = jp_fetch(
        "gpushare", "stream", params={"interval": "0.2"}, streaming_callback=on_chunk,
        request_timeout=5,
    )  # fmt: skip
    await asyncio.sleep(4.0)
    during = open_sockets(pid)
    with pytest.raises(HTTPClientError):  # the stream never ends by itself: it times out
        await stream
    text = b"".join(chunk for _, chunk in arrivals)
    assert text.count(b"event: snapshot") >= 15, text[:200]
    assert b"event: unavailable" not in text
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(arrivals)]
    assert max(gaps) < 1.5, gaps
    assert during <= before + 2, (before, during)  # about 8 renewals: none left open


async def test_stream_shows_a_new_session_within_a_few_seconds(jp_fetch, sessions):
    events: list[tuple[str, dict]] = []
    buffer = b""

    def on_chunk(chunk: bytes) -> None:
        nonlocal buffer
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            lines = dict(line.split(b": ", 1) for line in block.split(b"\n"))
            events.append((lines[b"event"].decode(), json.loads(lines[b"data"])))

    stream = jp_fetch("gpushare", "stream", streaming_callback=on_chunk, request_timeout=6)
    await asyncio.sleep(1.0)
    assert events and events[0][0] == "snapshot"
    assert events[-1][1]["leases"] == []

    session = sessions()
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: session.request_lease(priority=HIGH, label="explore")
    )
    await asyncio.sleep(3.0)
    with pytest.raises(HTTPClientError):  # the stream never ends by itself: it times out
        await stream
    assert {e[0] for e in events} == {"snapshot"}
    latest = events[-1][1]
    assert [(lease["state"], lease["label"]) for lease in latest["leases"]] == [
        ("running", "explore")
    ]
    assert latest["devices"][0]["holders"] == [latest["leases"][0]["lease_id"]]


async def test_admin_drains_and_undrains_a_device(jp_fetch, running_broker):
    response = await jp_fetch(
        "gpushare", "admin", method="POST", body=json.dumps({"action": "drain", "device": 0})
    )
    assert json.loads(response.body)["ok"] is True
    assert (await get_json(jp_fetch, "snapshot"))["devices"][0]["drained"] is True

    await jp_fetch(
        "gpushare", "admin", method="POST", body=json.dumps({"action": "undrain", "device": 0})
    )
    assert (await get_json(jp_fetch, "snapshot"))["devices"][0]["drained"] is False


async def test_admin_cancels_a_queued_request(jp_fetch, sessions):
    high, low = sessions(), sessions()
    high.request_lease(priority=HIGH)
    queued = low.request_lease(priority=LOW)

    await jp_fetch(
        "gpushare",
        "admin",
        method="POST",
        body=json.dumps({"action": "cancel", "lease_id": queued.lease_id}),
    )

    snapshot = await get_json(jp_fetch, "snapshot")
    assert [lease["priority"] for lease in snapshot["leases"]] == [HIGH]
    assert snapshot["queue_by_priority"]["low"] == 0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"action": "reboot", "device": 0}, "invalid admin request"),
        ({"action": "drain"}, "drain needs a device index"),
        ({"action": "cancel"}, "cancel needs a lease_id"),
    ],
)
async def test_admin_explains_a_bad_request(jp_fetch, running_broker, body, expected):
    with pytest.raises(HTTPClientError) as bad:
        await jp_fetch("gpushare", "admin", method="POST", body=json.dumps(body))
    assert bad.value.code == 400
    assert expected in json.loads(bad.value.response.body)["message"]


async def test_cancelling_an_unknown_request_says_so(jp_fetch, running_broker):
    with pytest.raises(HTTPClientError) as unknown:
        await jp_fetch(
            "gpushare",
            "admin",
            method="POST",
            body=json.dumps({"action": "cancel", "lease_id": "L999"}),
        )
    assert unknown.value.code == 404
    assert "L999" in json.loads(unknown.value.response.body)["message"]


async def test_kernels_the_server_starts_get_the_launch_shim(jp_fetch, jp_serverapp):
    import os

    from gpushare_ext.runtime.interpose import shim_path

    assert os.environ["LD_PRELOAD"].split(":")[0] == str(shim_path())


def test_the_launch_shim_goes_first_once_and_keeps_what_was_there():
    from gpushare_ext.runtime.interpose import shim_path
    from gpushare_ext.server_ext import preload_for_kernels

    environ = {"LD_PRELOAD": "/opt/other.so"}
    said = preload_for_kernels(environ)
    assert environ["LD_PRELOAD"] == f"{shim_path()}:/opt/other.so"
    assert said == f"kernels start with the launch shim {shim_path()}"
    preload_for_kernels(environ)
    assert environ["LD_PRELOAD"] == f"{shim_path()}:/opt/other.so"  # not twice

    turned_off = {"GPUSHARE_INTERPOSER": "off"}
    assert "off" in preload_for_kernels(turned_off) and "LD_PRELOAD" not in turned_off
    assert "GPUSHARE_PARKABLE_MEMORY" not in environ  # off unless asked for

    parkable: dict[str, str] = {}
    said = preload_for_kernels(parkable, parkable_memory=True)
    assert parkable["GPUSHARE_PARKABLE_MEMORY"] == "1" and said.endswith("and parkable memory")


async def test_history_is_the_last_hour_of_each_gpu_as_json(jp_fetch, sessions):
    client = sessions()
    grant = client.request_lease(priority=LOW, memory_bytes=4 * 1024**3, label="train")
    for _ in range(40):
        history = await get_json(jp_fetch, "history")
        device = history["devices"][0]
        if device["spans"] and device["spans"][0]["label"] and device["memory"]:
            break
        await asyncio.sleep(0.25)
    assert history["window_s"] == 3600.0
    assert len(device["times"]) == len(device["utilization_pct"]) == len(device["queued"])
    (span,) = device["spans"]
    assert (span["lease_id"], span["label"], span["own"]) == (grant.lease_id, "train", True)
    (leased,) = [s for s in device["memory"] if s["kind"] == "leased"]
    assert leased["mib"][-1] == 4 * 1024 and len(leased["mib"]) == len(device["times"])

    one = await get_json(jp_fetch, "history", params={"device": "0"})
    assert [d["index"] for d in one["devices"]] == [0]
    for bad in ("x", "-1", "99999"):
        with pytest.raises(HTTPClientError) as refused:
            await jp_fetch("gpushare", "history", params={"device": bad})
        assert refused.value.code == 400
