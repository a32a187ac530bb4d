"""Who is an admin, as the panel shows it: what the broker decides, as for the command line.

The broker decides from the host's user database whether the user at the other end of a
connection is an admin (``broker.admin_groups``).  ``gpushare`` on the command line opens
a connection per command, so a user added to the admin group is an admin there at once.
The panel's stream is one long request, which stays open for days: the server extension
renews its broker connection every ``IDENTITY_RENEWAL_S``, so the panel follows within
that time, without a reload, both ways.

A real system broker, and ``jupyter lab`` running as a real Unix user (needs root),
driven by headless Chromium.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import ensure_users, free_port, is_root
from test_browser import (  # noqa: F401 - the fixtures of the browser tests
    SERVER_CONFIG,
    SETTLE_MS,
    Lab,
    lab_command,
    page,
    stop_lab,
    wait_for_server,
)

from gpushare_ext.server_ext.handlers import IDENTITY_RENEWAL_S

pytestmark = [
    pytest.mark.browser,
    pytest.mark.multiuser,
    pytest.mark.skipif(not is_root(), reason="runs JupyterLab as another Unix user: needs root"),
]

USER = "gpspanel"
ADMINS = "gpspaneladmins"
# The panel follows a change within the renewal, a refresh of the panel, and some slack.
FOLLOWS_MS = int((IDENTITY_RENEWAL_S + 10) * 1000)


def as_user(name: str) -> dict:
    """Popen's arguments that run a command as ``name``, with the groups a login gives."""
    entry = pwd.getpwnam(name)
    return {
        "user": entry.pw_uid,
        "group": entry.pw_gid,
        "extra_groups": os.getgrouplist(name, entry.pw_gid),
    }


@pytest.fixture
def panel_user() -> Iterator[str]:
    """A Unix user outside the admin group (which exists, and is left removed after)."""
    ensure_users(USER)
    subprocess.run(["groupadd", "-f", ADMINS], check=True)
    subprocess.run(["gpasswd", "-d", USER, ADMINS], capture_output=True)  # if left in it
    yield USER
    subprocess.run(["gpasswd", "-d", USER, ADMINS], capture_output=True)
    subprocess.run(["groupdel", ADMINS], capture_output=True)


@pytest.fixture
def system_broker(start_broker):
    return start_broker(system=True, config_toml=f'[broker]\nadmin_groups = ["{ADMINS}"]\n')


@pytest.fixture
def lab(system_broker, panel_user) -> Iterator[Lab]:
    """``jupyter lab`` as ``panel_user``, its server extension on the system broker."""
    home = Path(tempfile.mkdtemp(prefix="gps-admin-", dir="/tmp"))
    root, config = home / "notebooks", home / "config"
    (config / "jupyter_server_config.d").mkdir(parents=True)
    root.mkdir()
    shutil.copy(SERVER_CONFIG, config / "jupyter_server_config.d" / SERVER_CONFIG.name)
    (config / "labconfig").mkdir()
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    entry = pwd.getpwnam(panel_user)
    for path in [home, *home.rglob("*")]:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    port, token = free_port(), "gpushare-admin-test"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "USER": panel_user,
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTER_DATA_DIR": str(home / "data"),
    }
    log_path = home / "lab.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        lab_command(port, token, root, system_broker.socket, home),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=root,
        **as_user(panel_user),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, token, process, log_path)
        yield Lab(url=url, token=token, root=root)
    finally:
        stop_lab(process)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def admin_on_the_command_line(user: str, socket: Path) -> bool:
    """What ``gpushare status --json``, run now as ``user``, says of them."""
    out = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "status", "--json", "--socket", str(socket)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp"},
        **as_user(user),
    )
    return json.loads(out.stdout)["is_admin"]


def test_a_user_joining_the_admin_group_gets_the_admin_buttons_without_a_reload(
    page,  # noqa: F811
    system_broker,
    panel_user,
):
    from playwright.sync_api import expect

    page.locator('.jp-SideBar .lm-TabBar-tab[data-id="gpushare-panel"]').click()
    panel = page.locator("#gpushare-panel")
    you = panel.locator(".gpushare-you")
    drain = panel.locator(".gpushare-device-title .gpushare-admin-button")
    expect(you).to_have_text(f"you: {panel_user}", timeout=SETTLE_MS)
    expect(drain).to_have_count(0)
    assert not admin_on_the_command_line(panel_user, system_broker.socket)

    subprocess.run(["usermod", "-aG", ADMINS, panel_user], check=True)
    assert panel_user in grp.getgrnam(ADMINS).gr_mem
    assert admin_on_the_command_line(panel_user, system_broker.socket)  # at once
    expect(you).to_have_text(f"you: {panel_user} (admin)", timeout=FOLLOWS_MS)
    expect(drain).to_have_text("Drain")

    subprocess.run(["gpasswd", "-d", panel_user, ADMINS], check=True, capture_output=True)
    assert not admin_on_the_command_line(panel_user, system_broker.socket)
    expect(you).to_have_text(f"you: {panel_user}", timeout=FOLLOWS_MS)
    expect(drain).to_have_count(0)
