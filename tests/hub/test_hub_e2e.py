"""End to end: two Unix users share one (simulated) GPU through a real JupyterHub.

Set-up (conftest.py, the steps of docs/deploy.md): a venv in /opt/gpushare-e2e with the
package and JupyterHub, the extension enabled for every kernel by a system-wide IPython
config, the server extension enabled by the package's data files, the example policy
(deploy/broker.toml), the system broker as root on /run/gpushare/broker.sock, and
JupyterHub (the shared-password authenticator, LocalProcessSpawner) loading
deploy/jupyterhub_config.py.

The story, as the two users live it:
1. a student (``gps-alice``) starts a low-priority training loop: it holds the GPU;
2. a staff member (``gps-bob``) runs a high-priority cell: it is granted at once and the
   student's loop is paused; both see it in their status, each seeing the other only
   as an anonymous ``user-xxxx``;
3. from another notebook the student can neither release the staff member's lease nor
   open their control block;
4. the staff cell ends and the loop resumes;
5. the broker is restarted (SIGTERM, as systemd does) while the loop holds its lease:
   the loop's session reconnects to the new broker and reclaims the same lease, nothing
   stays paused, and the loop's cell completes normally.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from hub_driver import HubError, Kernel, UserServer
from local_install import PREFIX, STAFF, STUDENT

pytestmark = [pytest.mark.hub, pytest.mark.timeout(420)]

EXTENSION_LOADED = """\
import shutil
ip = get_ipython()
print("gpushare loaded:", "gpushare_ext" in ip.extension_manager.loaded,
      "| %%gpu defined:", "gpu" in ip.magics_manager.magics["cell"],
      "| gpushare on PATH:", shutil.which("gpushare"))
"""

# A training loop: low priority, a safe point per step, until the test says stop.
TRAINING_CELL = """\
%%gpu priority=low mem=2GiB
import os, time, gpushare_ext
from gpushare_ext.runtime.session import current_session
print("LEASE", next(iter(current_session().leases)), flush=True)
stop = os.path.expanduser("~/stop-training")
progress = os.path.expanduser("~/training-progress")
steps, held = 0, []
deadline = time.monotonic() + 240
while not os.path.exists(stop) and time.monotonic() < deadline:
    started = time.monotonic()
    gpushare_ext.safe_point()
    if time.monotonic() - started > 0.2:
        held.append(round(time.monotonic() - started, 1))
    steps += 1
    if steps % 10 == 0:
        with open(progress, "w") as out:
            out.write(str(steps))
    time.sleep(0.02)
print("TRAINING DONE", {"steps": steps, "held_s": held}, flush=True)
"""

# An interactive cell: high priority, holds the GPU until the test says stop.
INTERACTIVE_CELL = """\
%%gpu priority=high mem=2GiB
import os, time
from gpushare_ext.runtime.session import current_session
session = current_session()
print("LEASE", next(iter(session.leases)), "BLOCK", session.client.welcome.control_block,
      flush=True)
stop = os.path.expanduser("~/stop-interactive")
deadline = time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.02)
print("INTERACTIVE DONE", flush=True)
"""

# What a curious student tries from another notebook against the staff member's session.
PROBE_CELL = """\
import os
from gpushare_ext.client import BrokerClient, BrokerError
findings = {{}}
with BrokerClient(client="cli") as client:
    try:
        client.release({lease!r})
        findings["release"] = "released"
    except BrokerError as exc:
        findings["release"] = exc.code.value
try:
    open({block!r}, "rb").close()
    findings["control_block"] = "opened"
except OSError as exc:
    findings["control_block"] = type(exc).__name__
try:
    findings["sessions_dir"] = sorted(os.listdir(os.path.dirname({block!r})))
except OSError as exc:
    findings["sessions_dir"] = type(exc).__name__
print("FINDINGS", findings)
"""


def marker(user: str, name: str) -> Path:
    return Path(os.path.expanduser(f"~{user}")) / name


def printed_value(text: str, key: str) -> str:
    """The word after ``key`` on the line that starts with it."""
    for line in text.splitlines():
        if line.startswith(key + " "):
            return line.split()[1]
    raise AssertionError(f"no line starting with {key!r} in:\n{text}")


def cli_status(user: str) -> dict:
    """``gpushare status --json`` run as ``user``, finding the system broker by itself."""
    # The suite points GPUSHARE_SYSTEM_SOCKET away from /run/gpushare; this test's own
    # system broker is there (the host has none, or the test skipped).
    hidden = ("GPUSHARE_SOCKET", "GPUSHARE_SYSTEM_SOCKET", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    done = subprocess.run(
        ["runuser", "-u", user, "--", str(PREFIX / "bin" / "gpushare"), "status", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def lease(snapshot: dict, lease_id: str) -> dict:
    for view in snapshot["leases"]:
        if view["lease_id"] == lease_id:
            return view
    raise AssertionError(f"lease {lease_id} not in the snapshot: {snapshot['leases']}")


def wait_for(predicate, what: str, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (AssertionError, HubError, KeyError, OSError) as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def servers(hub, users) -> tuple[UserServer, UserServer]:
    """Both users' servers, started through the hub's REST API, with each user's token."""
    for name in users:
        hub.hub.start_server(name)
    for name in users:
        hub.hub.wait_ready(name)
    return hub.hub.server(STUDENT), hub.hub.server(STAFF)


def test_two_users_share_the_gpu_through_jupyterhub(hub, servers, system_broker, workdir):
    alice, bob = servers
    training = alice.open_notebook("training.ipynb")
    interactive = bob.open_notebook("interactive.ipynb")
    kernels: list[Kernel] = [training, interactive]
    try:
        for kernel in kernels:
            shown = kernel.run(EXTENSION_LOADED).text
            assert "gpushare loaded: True | %%gpu defined: True" in shown, shown
            assert f"| gpushare on PATH: {PREFIX}/bin/gpushare" in shown, shown

        # 1. The student's low-priority loop holds the GPU.
        loop = training.start(TRAINING_CELL)
        alice_lease = printed_value(loop.wait_for_text("LEASE", timeout=30), "LEASE")
        seen = alice.snapshot()  # through the server extension, with the student's token
        assert seen["you"] == STUDENT and seen["mode"] == "system"
        assert lease(seen, alice_lease)["state"] == "running"
        first_broker = seen["broker_pid"]
        assert first_broker == system_broker.pid

        # 2. The staff member's high-priority cell is granted at once; the loop is paused.
        cell = interactive.start(INTERACTIVE_CELL)
        printed = cell.wait_for_text("BLOCK", timeout=30)
        bob_lease = printed_value(printed, "LEASE")
        bob_block = printed.split("BLOCK", 1)[1].split()[0]
        assert "queued" not in cell.text, "the high-priority cell should not have waited"

        def alice_paused() -> dict:
            view = cli_status(STUDENT)
            return view if lease(view, alice_lease)["state"] == "paused" else {}

        as_alice = wait_for(alice_paused, "the student's lease to be paused")
        as_bob = cli_status(STAFF)
        # The student sees their own lease paused and an anonymous high-priority holder.
        own, other = lease(as_alice, alice_lease), lease(as_alice, bob_lease)
        assert own["own"] and own["user"] == STUDENT
        assert other["state"] == "running" and not other["own"]
        assert other["user"].startswith("user-") and STAFF not in json.dumps(as_alice)
        assert other["pid"] is None and other["label"] == "" and other["notebook"] == ""
        # The staff member sees their lease running, granted without waiting, and the
        # student's paused lease, anonymously.
        mine, theirs = lease(as_bob, bob_lease), lease(as_bob, alice_lease)
        assert mine["state"] == "running" and mine["waited_s"] < 1.0
        assert mine["notebook"].endswith("interactive.ipynb")
        assert theirs["state"] == "paused" and theirs["user"].startswith("user-")
        assert STUDENT not in json.dumps(as_bob)
        # The student's cell says why it stopped, without naming who.
        notice = wait_for(
            lambda: [t for t in loop.all_display_texts if "paused for a higher-priority" in t],
            "the pause notice in the student's cell",
        )
        assert STAFF not in notice[0] and "user-" in notice[0]

        # 3. The student cannot act on or read the staff member's session.
        probe = alice.open_notebook("probe.ipynb")
        kernels.append(probe)
        shown = probe.run(PROBE_CELL.format(lease=bob_lease, block=bob_block)).text
        findings = ast.literal_eval(shown.split("FINDINGS", 1)[1].strip())
        assert findings == {
            "release": "permission",
            "control_block": "PermissionError",
            "sessions_dir": "PermissionError",
        }
        assert lease(cli_status(STAFF), bob_lease)["state"] == "running"

        # 4. The staff cell ends; the student's loop resumes.
        marker(STAFF, "stop-interactive").touch()
        finished = cell.wait(timeout=30)
        assert finished.succeeded(), finished.text
        assert "INTERACTIVE DONE" in finished.text
        wait_for(
            lambda: lease(alice.snapshot(), alice_lease)["state"] == "running",
            "the student's lease to run again",
        )
        wait_for(
            lambda: any("resumed after" in t for t in loop.all_display_texts),
            "the resume notice in the student's cell",
        )

        # 5. The broker restarts while the loop holds its lease.
        assert system_broker.stop() == 0
        system_broker.start()
        assert system_broker.pid != first_broker

        def reclaimed() -> dict:
            view = alice.snapshot()
            return view if view["broker_pid"] == system_broker.pid else {}

        after = wait_for(reclaimed, "the server extension to reach the new broker")
        wait_for(
            lambda: lease(alice.snapshot(), alice_lease)["state"] == "running",
            "the loop's session to reclaim its lease from the new broker",
        )
        assert after["mode"] == "system"
        # Nothing stays paused: the loop keeps stepping under the new broker.
        steps_before = training_progress()
        wait_for(lambda: training_progress() > steps_before + 20, "the loop to make progress")

        marker(STUDENT, "stop-training").touch()
        done = loop.wait(timeout=60)
        assert done.succeeded(), done.text
        assert "revoked" not in done.text, done.text
        summary = ast.literal_eval(done.text.split("TRAINING DONE", 1)[1].strip().splitlines()[0])
        assert summary["steps"] > steps_before
        assert summary["held_s"], "the loop should have been held while the staff cell ran"

        # Nothing is left behind: no lease, no preemption the journal would still undo.
        final = cli_status(STAFF)
        assert final["leases"] == []
        assert_nothing_pending(workdir / "journal.sqlite")
    finally:
        for kernel in kernels:
            kernel.close()


def training_progress() -> int:
    """Steps the student's loop has made, from the file it updates every ten steps."""
    path = marker(STUDENT, "training-progress")
    return int(path.read_text() or 0) if path.exists() else 0


def assert_nothing_pending(journal_path: Path) -> None:
    from gpushare_ext.broker.hands.journal import Journal

    journal = Journal(journal_path)
    try:
        assert list(journal.pending_actuations()) == []
        assert list(journal.open_leases()) == []
    finally:
        journal.close()


def test_both_users_log_in_and_land_on_jupyterlab_with_the_gpu_panel(hub, servers):
    """docs/deploy.md's "Log in as ..., the GPU panel in JupyterLab shows the broker's
    view for that user", done for each user in a real browser (Debian's Chromium), each
    in a browser context of their own (no shared cookies)."""
    from playwright.sync_api import expect, sync_playwright

    chromium = Path("/usr/bin/chromium")
    assert chromium.exists(), "install it with `apt-get install -y chromium`"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            for user in (STUDENT, STAFF):
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = context.new_page()
                page.goto(f"{hub.hub.url}/hub/login")
                page.fill("#username_input", user)
                page.fill("#password_input", hub.password)
                page.click("#login_submit")
                page.wait_for_url(f"**/user/{user}/lab**", timeout=60_000)
                page.wait_for_selector("#jp-main-statusbar", timeout=60_000)
                expect(page.locator(".gpushare-statusbar")).to_contain_text("GPU:", timeout=20_000)
                page.locator('.jp-SideBar .lm-TabBar-tab[data-id="gpushare-panel"]').click()
                panel = page.locator("#gpushare-panel")
                expect(panel.locator(".gpushare-device").first).to_be_visible(timeout=20_000)
                expect(panel).to_contain_text(f"you: {user}")
                expect(panel).to_contain_text("system mode")
                context.close()
        finally:
            browser.close()
