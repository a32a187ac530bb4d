"""The systemd-less local install of docs/deploy.md, as commands the e2e test runs.

Every command here appears verbatim (with ``$PREFIX``, ``$REPO``, ``$CONFIG`` ...
unexpanded) in ``docs/deploy.md``; ``tests/deploy/test_deploy_files.py`` checks that, so the
walkthrough and the end-to-end test cannot drift apart.  Expansion happens only here.

The install is slow (a venv with JupyterHub and the package), so it is skipped when the
prefix already holds an install of exactly this source: a stamp file records a hash of
``pyproject.toml``, the package's files and ``deploy/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = Path("/opt/gpushare-e2e")  # the world-readable venv the hub and its users run
STUDENT = "gps-alice"  # group students: at most priority normal, 16 GiB
STAFF = "gps-bob"  # group teachers: may ask for priority high

REPO = Path(__file__).resolve().parents[2]

#: 1. A world-readable virtual environment built with the system interpreter (the root
#:    user's own Python may live in a 0700 home that notebook users cannot run).
CREATE_VENV = "/usr/bin/python3 -m venv $PREFIX"
#: 2. The package with its JupyterLab extra (the hub opens /lab), and JupyterHub.
INSTALL_PACKAGES = '$PREFIX/bin/pip install "$REPO[lab]" "jupyterhub>=5.3"'
#:    pip keeps an installed 0.1.0 unless told: reinstall the package itself on changes.
REINSTALL_PACKAGE = "$PREFIX/bin/pip install --no-deps --force-reinstall $REPO"
#: 3. Everyone may read and run it.
MAKE_READABLE = "chmod -R a+rX $PREFIX"
#: 4. JupyterHub's proxy, from npm.
INSTALL_PROXY = "npm install -g configurable-http-proxy@5.3.0"
#: 5. Unix groups and users (the policy names the groups).
ADD_GROUPS = "groupadd -f students && groupadd -f teachers && groupadd -f gpuadmin"
ADD_USER = "useradd -m -G $GROUP $USERNAME"
#: 6. Every IPython kernel of this prefix loads the extension (ENV_CONFIG_DIRS).
INSTALL_IPYTHON_CONFIG = (
    "install -D -m 0644 $REPO/deploy/ipython_config.py $PREFIX/etc/ipython/ipython_config.py"
)
#: 7. The policy.
INSTALL_POLICY = "install -D -m 0644 $REPO/deploy/broker.toml $CONFIG"
#: 8. The system broker, as root (--simulate h200 only on a machine without a GPU).
START_BROKER = (
    "$PREFIX/bin/gpushare broker --system --config $CONFIG --journal $JOURNAL --simulate h200"
)
#: 9. The hub, with a config that loads deploy/jupyterhub_config.py.
START_HUB = "$PREFIX/bin/jupyterhub -f $HUB_CONFIG"

COMMANDS = (
    CREATE_VENV,
    INSTALL_PACKAGES,
    REINSTALL_PACKAGE,
    MAKE_READABLE,
    INSTALL_PROXY,
    ADD_GROUPS,
    ADD_USER,
    INSTALL_IPYTHON_CONFIG,
    INSTALL_POLICY,
    START_BROKER,
    START_HUB,
)


def expand(command: str, **values: str | Path) -> str:
    """``command`` with each ``$NAME`` replaced, longest names first."""
    for name in sorted(values, key=len, reverse=True):
        command = command.replace(f"${name}", str(values[name]))
    assert "$" not in command, f"unexpanded variable in {command!r}"
    return command


def run(command: str, timeout: float = 600, **values: str | Path) -> None:
    text = expand(command, REPO=REPO, **values)
    done = subprocess.run(
        ["bash", "-c", text],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=environment_without_venv(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{text}` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def source_hash() -> str:
    """What the installed copy must match: pyproject.toml and every package file."""
    digest = hashlib.sha256()
    files = [
        REPO / "pyproject.toml",
        *sorted((REPO / "gpushare_ext").rglob("*")),
        *sorted((REPO / "deploy").rglob("*")),  # installed too: the hub loads its config
    ]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(REPO)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Install:
    prefix: Path

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    @property
    def stamp(self) -> Path:
        return self.prefix / ".gpushare-source-hash"

    def is_current(self) -> bool:
        return (
            (self.bin / "jupyterhub").exists()
            and (self.bin / "gpushare").exists()
            and self.stamp.exists()
            and self.stamp.read_text().strip() == source_hash()
        )

    def ensure(self) -> None:
        """Steps 1-4: venv, packages, permissions, proxy; idempotent and cached."""
        if not self.is_current():
            if not (self.bin / "python").exists():
                run(CREATE_VENV, PREFIX=self.prefix)
            run(INSTALL_PACKAGES, PREFIX=self.prefix)
            run(REINSTALL_PACKAGE, PREFIX=self.prefix)
            run(MAKE_READABLE, PREFIX=self.prefix)
            self.stamp.write_text(source_hash() + "\n")
            self.stamp.chmod(0o644)
        if shutil.which("configurable-http-proxy") is None:
            run(INSTALL_PROXY)

    def install_ipython_config(self) -> Path:
        """Step 6: the extension for every kernel of this prefix."""
        run(INSTALL_IPYTHON_CONFIG, PREFIX=self.prefix)
        return self.prefix / "etc" / "ipython" / "ipython_config.py"


def ensure_user(name: str, group: str) -> None:
    """Step 5: the groups and a user in one of them (idempotent)."""
    run(ADD_GROUPS)
    if subprocess.run(["id", "-u", name], capture_output=True, check=False).returncode != 0:
        run(ADD_USER, GROUP=group, USERNAME=name)
    else:
        subprocess.run(["usermod", "-a", "-G", group, name], check=True)


def environment_without_venv() -> dict[str, str]:
    """The environment for commands of the install: no VIRTUAL_ENV of the test runner."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("GPUSHARE_SOCKET", None)
    env.pop("GPUSHARE_SYSTEM_SOCKET", None)  # the hub's kernels find its broker themselves
    return env
