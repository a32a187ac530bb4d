"""The hub test's set-up: docs/deploy.md's "1. On one machine, without systemd", run from the page.

What it is for: the walkthrough's code blocks (read by :mod:`deploy_doc`) are run in
order as the page writes them, with only the test's own paths, ports, users and password
put where the page writes the admin's (:func:`substitutions`, each of which fails when
the page no longer writes it), and after each step what the page promises for it is
checked; a broken promise raises :class:`StepFailed`, one line naming the step.  The two
long-running commands (step 8's broker, step 9's hub) are handed to the fixtures as
scripts to start in the background, exactly as written but for an ``exec``.

Steps 1-3 (a venv with JupyterHub and the package) are slow, so they are skipped when
the prefix already holds an install of exactly this source: a stamp records a hash of
``pyproject.toml``, the package's files, ``deploy/`` and those steps' commands.  Their
checks run all the same.

What it must not do: write any of the page's own paths (``/opt/gpushare``,
``/etc/gpushare``, ``/var/lib/gpushare``, ``/etc/jupyterhub``, ``/var/lib/jupyterhub``) or
use its port 8000: every prepared block is searched for them before anything runs.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import shlex
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from deploy_doc import VARIABLES_STEP, Block, DocDrift, Substitution, read_walkthrough, substitute

PREFIX = Path("/opt/gpushare-e2e")  # the world-readable venv the hub and its users run
STUDENT = "gps-alice"  # group students: at most priority normal, 16 GiB
STAFF = "gps-bob"  # group teachers: may ask for priority high
GROUPS = {STUDENT: "students", STAFF: "teachers"}  # step 5's GROUP for each USERNAME
# "Everyone" of steps 1 and 3: an account in none of the test's groups, there before step 5.
ANY_ACCOUNT = "nobody"

REPO = Path(__file__).resolve().parents[2]
STEPS = list(range(1, 10))

# The page's own places, which belong to a real deployment of this host.
HOST_PLACES = re.compile(
    r"/opt/gpushare(?![-\w])|/etc/gpushare|/var/lib/gpushare|/etc/jupyterhub"
    r"|/var/lib/jupyterhub|127\.0\.0\.1:8000\b"
)
# The commands that keep running (the page says to keep them in a terminal's foreground):
# the last line of a block of that step starting with one is started in the background.
BACKGROUND_COMMANDS = {8: "$PREFIX/bin/gpushare broker ", 9: "$PREFIX/bin/jupyterhub "}
# Inline commands of the prose the test runs too: (step, the words just before them).
CHECK_AS_ANY_USER = (8, "Check it as any user: ")
FIXED_TOKEN_SETTING = (9, "and in `$HUB_CONFIG`, ")
TOKEN_SETTING_WRITTEN = '"api_token": secrets.token_hex(32)'

# Appended to step 9's config: ports the page leaves at JupyterHub's defaults (another hub
# may run on this machine) and patient spawns (CI machines are small).
TEST_ONLY_HUB_SETTINGS = """
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
"""

STEP_TIMEOUT_S = 1200  # step 2 builds the JupyterLab panel with npm on a small machine


class StepFailed(AssertionError):
    """A step of the walkthrough did not do what docs/deploy.md says it does."""


@dataclass(frozen=True)
class Choices:
    """What the test puts where the page writes the admin's choices."""

    workdir: Path  # a fresh root-owned 0755 folder of this run
    port: int  # the hub's public port (the page's 8000)
    hub_port: int
    proxy_api_port: int
    password: str
    prefix: Path = PREFIX

    @property
    def config(self) -> Path:
        return self.workdir / "etc" / "broker.toml"

    @property
    def journal(self) -> Path:
        return self.workdir / "journal.sqlite"

    @property
    def hub_config(self) -> Path:
        return self.workdir / "jupyterhub_config.py"

    @property
    def hub_state(self) -> Path:  # the page's /var/lib/jupyterhub
        return self.workdir / "hub"

    @property
    def hub_secrets(self) -> Path:  # the page's /etc/jupyterhub, for the token file
        return self.workdir / "jupyterhub"

    @property
    def token_file(self) -> Path:
        return self.hub_secrets / "gpushare-admin.token"


def substitutions(choices: Choices) -> list[Substitution]:
    """Every text of the page the test replaces, and with what: paths, ports, users and
    the password, nothing else."""
    quoted = {
        name: shlex.quote(str(getattr(choices, name)))
        for name in ("prefix", "config", "journal", "hub_config")
    }
    prefix = str(choices.prefix)
    return [
        Substitution(VARIABLES_STEP, "PREFIX=/opt/gpushare ", f"PREFIX={quoted['prefix']} "),
        Substitution(
            VARIABLES_STEP, "CONFIG=/etc/gpushare/broker.toml", f"CONFIG={quoted['config']}"
        ),
        Substitution(
            VARIABLES_STEP,
            "JOURNAL=/var/lib/gpushare/journal.sqlite",
            f"JOURNAL={quoted['journal']}",
        ),
        Substitution(
            VARIABLES_STEP,
            "HUB_CONFIG=/etc/jupyterhub/jupyterhub_config.py",
            f"HUB_CONFIG={quoted['hub_config']}",
        ),
        Substitution(8, "/opt/gpushare/", f"{prefix}/"),  # "Check it as any user: ..."
        Substitution(9, '"/opt/gpushare/', f'"{prefix}/'),  # load_subconfig(...)
        Substitution(9, '"http://127.0.0.1:8000"', f'"http://127.0.0.1:{choices.port}"'),
        Substitution(9, '"a trial password"', repr(choices.password)),
        Substitution(9, '{"gps-alice", "gps-bob"}', repr(set(GROUPS))),
        Substitution(9, "/etc/jupyterhub", str(choices.hub_secrets)),
        Substitution(9, "/var/lib/jupyterhub", str(choices.hub_state)),
    ]


@dataclass(frozen=True)
class Prepared:
    """The walkthrough's blocks with the test's choices in them, ready to run."""

    choices: Choices
    blocks: tuple[Block, ...]
    check_as_any_user: Block

    def block(self, step: int, language: str = "bash") -> Block:
        found = [b for b in self.blocks if b.step == step and b.language == language]
        if len(found) != 1:
            raise DocDrift(f"docs/deploy.md step {step} should have one {language} block")
        return found[0]

    def bash_blocks(self, step: int) -> list[Block]:
        return [b for b in self.blocks if b.step == step and b.language == "bash"]

    def background_block(self, step: int) -> Block:
        return next(b for b in self.bash_blocks(step) if is_background(b))


def is_background(block: Block) -> bool:
    command = BACKGROUND_COMMANDS.get(block.step)
    return command is not None and bool(block.lines) and block.lines[-1].startswith(command)


def prepare(choices: Choices, page: str | None = None) -> Prepared:
    """docs/deploy.md's walkthrough (or ``page``'s) with the test's choices put in;
    DocDrift, one line naming the step, where the test could not follow it as written."""
    walkthrough = read_walkthrough(page)
    if walkthrough.steps != STEPS:
        raise DocDrift(f"docs/deploy.md's walkthrough has steps {walkthrough.steps}, not 1 to 9")
    for step in [VARIABLES_STEP, *STEPS]:
        if not walkthrough.blocks_of(step):
            raise DocDrift(f"docs/deploy.md step {step} has no code block")
    inline = [
        walkthrough.inline_command(*CHECK_AS_ANY_USER),
        walkthrough.inline_command(*FIXED_TOKEN_SETTING),
    ]
    *blocks, check_as_any_user, token_setting = substitute(
        [*walkthrough.blocks, *inline], substitutions(choices)
    )
    # The hub reads its service token from the file of the page's "for a fixed one".
    blocks = substitute(blocks, [Substitution(9, TOKEN_SETTING_WRITTEN, token_setting.text)])
    prepared = Prepared(choices=choices, blocks=tuple(blocks), check_as_any_user=check_as_any_user)
    for step in BACKGROUND_COMMANDS:
        last = prepared.bash_blocks(step)[-1:]
        if not last or not is_background(last[0]):
            raise DocDrift(
                f"docs/deploy.md step {step}'s last block no longer ends with "
                f"{BACKGROUND_COMMANDS[step]!r}"
            )
    for block in [*prepared.blocks, check_as_any_user]:
        place = HOST_PLACES.search(block.text)
        if place:
            raise DocDrift(
                f"docs/deploy.md {block.name} writes {place[0]}, which the hub test does not "
                "replace: it would change this host's own deployment"
            )
    return prepared


# ------------------------------------------------------------------ running the page


def environment_without_venv() -> dict[str, str]:
    """The environment for commands of the install: no VIRTUAL_ENV of the test runner."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("GPUSHARE_SOCKET", None)
    env.pop("GPUSHARE_SYSTEM_SOCKET", None)  # the hub's kernels find its broker themselves
    return env


def failure(block_or_step: Block | str, what: str) -> StepFailed:
    name = block_or_step.name if isinstance(block_or_step, Block) else block_or_step
    return StepFailed(f"docs/deploy.md {name}: {what}")


def run_command(
    argv: list[str], owner: Block, *, env: dict[str, str] | None = None, timeout: float = 120
) -> str:
    """``argv``'s output; StepFailed naming ``owner``'s step if it fails."""
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd="/",  # every user may stand there
            env=environment_without_venv() if env is None else env,
        )
    except subprocess.TimeoutExpired:
        raise failure(owner, f"`{shlex.join(argv)}` ran past {timeout} s") from None
    if done.returncode != 0:
        raise failure(
            owner,
            f"`{shlex.join(argv)}` failed ({done.returncode})\n{done.stdout}\n{done.stderr}",
        )
    return done.stdout


def as_user(user: str, *argv: str) -> list[str]:
    return ["runuser", "-u", user, "--", *argv]


class LocalInstall:
    """The prepared walkthrough, run step by step on this machine, each step checked."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.choices = prepared.choices

    @property
    def prefix(self) -> Path:
        return self.choices.prefix

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    @property
    def stamp(self) -> Path:
        return self.prefix / ".gpushare-source-hash"

    # -------------------------------------------------------------- shell

    def script(self, text: str) -> str:
        """``text`` after the variables block, as pasted into one terminal after it."""
        variables = self.prepared.block(VARIABLES_STEP).text
        return f"set -euo pipefail\n{variables}{text}"

    def run(self, block: Block, text: str | None = None) -> None:
        """Run ``block`` (or ``text`` in its name) to completion from the checkout."""
        script = self.script(block.text if text is None else text)
        print(f"--- {block.name}\n{script}", flush=True)
        try:
            done = subprocess.run(
                ["bash", "-c", script],
                cwd=REPO,  # "Run as root from a checkout of the repository"
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S,
                check=False,
                env=environment_without_venv(),
            )
        except subprocess.TimeoutExpired:
            raise failure(block, f"ran past {STEP_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise failure(block, f"failed ({done.returncode})\n{done.stdout}\n{done.stderr}")

    def background_script(self, step: int) -> str:
        """Step ``step``'s long-running block as a script whose process becomes the
        program (``exec``): its pid is the broker's or the hub's, signals reach it."""
        block = self.prepared.background_block(step)
        *before, last = block.lines
        script = self.script("\n".join([*before, f"exec {last}", ""]))
        print(f"--- {block.name}, in the background\n{script}", flush=True)
        return script

    # -------------------------------------------------------------- steps 0 to 4

    def check_variables(self) -> None:
        """Step 0: the variables are the test's own (the checkout is where it runs)."""
        block = self.prepared.block(VARIABLES_STEP)
        names = ("REPO", "PREFIX", "CONFIG", "JOURNAL", "HUB_CONFIG")
        shown = subprocess.run(
            ["bash", "-c", self.script("printf '%s\\n' " + " ".join(f'"${n}"' for n in names))],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            env=environment_without_venv(),
        ).stdout.splitlines()
        c = self.choices
        wanted = [str(p) for p in (REPO, c.prefix, c.config, c.journal, c.hub_config)]
        if shown != wanted:
            raise failure(block, f"sets {shown}, not the test's {wanted} ({', '.join(names)})")

    def install_environment(self) -> None:
        """Steps 1 to 4: the venv, the packages, everyone's rights, the proxy."""
        self.check_variables()
        current = self.is_current()
        if not current and not (self.bin / "python").exists():
            self.run(self.prepared.block(1))
        self.check_step_1()
        if not current:
            self.run(self.prepared.block(2))
        self.check_step_2()
        if not current:
            self.run(self.prepared.block(3))
            self.stamp.write_text(self.source_hash() + "\n")
            self.stamp.chmod(0o644)
        self.check_step_3()
        proxy = self.prepared.block(4)
        if proxy_version() != pinned_proxy_version(proxy):
            self.run(proxy)
        self.check_step_4()

    def source_hash(self) -> str:
        """What the installed copy must match: pyproject.toml, every package file,
        deploy/ (the hub loads its config) and the commands of steps 1 to 3."""
        digest = hashlib.sha256()
        files = [
            REPO / "pyproject.toml",
            *sorted((REPO / "gpushare_ext").rglob("*")),
            *sorted((REPO / "deploy").rglob("*")),
        ]
        for path in files:
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode())
                digest.update(path.read_bytes())
        for step in (1, 2, 3):
            digest.update(self.prepared.block(step).text.encode())
        return digest.hexdigest()

    def is_current(self) -> bool:
        return self.stamp.exists() and self.stamp.read_text().strip() == self.source_hash()

    def check_step_1(self) -> None:
        """The venv's interpreter is the system's, and an account of nobody's runs it."""
        block = self.prepared.block(1)
        python = self.bin / "python"
        real = Path(os.path.realpath(python))
        if not python.exists() or real.parts[:3] != ("/", "usr", "bin"):
            raise failure(block, f"{python} is not the system's Python (it is {real})")
        shown = run_command(
            as_user(ANY_ACCOUNT, str(python), "-c", "import sys; print(sys.prefix)"), block
        )
        if shown.strip() != str(self.prefix):
            raise failure(block, f"{python} run as {ANY_ACCOUNT} has sys.prefix {shown.strip()}")

    def check_step_2(self) -> None:
        """The commands, the lab extra, the data files, and the source's own package."""
        block = self.prepared.block(2)
        for name in ("gpushare", "jupyterhub", "jupyter-lab"):
            if not os.access(self.bin / name, os.X_OK):
                raise failure(block, f"{self.bin / name} is missing")
        wanted = re.search(r'"jupyterhub>=([\d.]+)"', block.text)
        version = run_command([str(self.bin / "jupyterhub"), "--version"], block).strip()
        if wanted and version_tuple(version) < version_tuple(wanted[1]):
            raise failure(block, f"JupyterHub {version} is installed, not {wanted[0]}")
        enabling = self.prefix / "etc/jupyter/jupyter_server_config.d/gpushare_ext.json"
        try:
            enabled = json.loads(enabling.read_text())["ServerApp"]["jpserver_extensions"]
        except (OSError, ValueError, KeyError) as exc:
            raise failure(block, f"{enabling} does not enable the extension: {exc}") from None
        if enabled.get("gpushare_ext") is not True:
            raise failure(block, f"{enabling} does not enable gpushare_ext: {enabled}")
        for expected in (
            self.prefix / "share/jupyter/labextensions/gpushare-ext/package.json",  # the panel
            self.prefix / "share/gpushare/deploy/jupyterhub_config.py",
            self.prefix / "share/doc/gpushare/deploy.md",
        ):
            if not expected.is_file():
                raise failure(block, f"{expected} is missing")
        # "reinstall the package itself": the prefix runs this source, not an older copy.
        where = run_command(
            [str(self.bin / "python"), "-c", "import gpushare_ext; print(gpushare_ext.__file__)"],
            block,
        )
        installed = Path(where.strip()).parent
        for source in sorted((REPO / "gpushare_ext").rglob("*.py")):
            copy = installed / source.relative_to(REPO / "gpushare_ext")
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                raise failure(block, f"{copy} is not this checkout's {source.relative_to(REPO)}")

    def check_step_3(self) -> None:
        """Every file readable, every folder and program usable, by everyone."""
        block = self.prepared.block(3)
        unreadable = next(iter(unreadable_by_others(self.prefix)), None)
        if unreadable is not None:
            raise failure(block, f"{unreadable} is not readable by everyone")
        run_command(
            as_user(
                ANY_ACCOUNT,
                str(self.bin / "python"),
                "-c",
                "import gpushare_ext, jupyterhub, jupyterlab",
            ),
            block,
        )

    def check_step_4(self) -> None:
        block = self.prepared.block(4)
        wanted = pinned_proxy_version(block)
        if proxy_version() != wanted:
            raise failure(
                block, f"`configurable-http-proxy --version` is {proxy_version()!r}, not {wanted}"
            )

    # -------------------------------------------------------------- steps 5 to 7

    def add_users(self) -> None:
        """Step 5: the groups, and each user not there yet in their group; a user an older
        run left outside their group is put in it."""
        block = self.prepared.block(5)
        missing = {name: group for name, group in GROUPS.items() if not user_exists(name)}
        self.run(block, users_script(block, missing))
        for name, group in GROUPS.items():
            if group not in groups_of(name):
                subprocess.run(["usermod", "-a", "-G", group, name], check=True)
        self.check_step_5()

    def check_step_5(self) -> None:
        block = self.prepared.block(5)
        for group in re.findall(r"groupadd -f (\S+)", block.text):
            try:
                grp.getgrnam(group)
            except KeyError:
                raise failure(block, f"group {group} does not exist") from None
        for name, group in GROUPS.items():
            if not user_exists(name):
                raise failure(block, f"user {name} does not exist")
            home = Path(pwd.getpwnam(name).pw_dir)
            if not home.is_dir() or home.stat().st_uid != pwd.getpwnam(name).pw_uid:
                raise failure(block, f"{name} has no home of their own ({home})")
            if group not in groups_of(name):
                raise failure(block, f"{name} is not in group {group} ({groups_of(name)})")

    def install_kernel_config(self) -> None:
        """Step 6, then: a kernel of the prefix has %%gpu without %load_ext, for a user."""
        block = self.prepared.block(6)
        self.run(block)
        config = self.prefix / "etc" / "ipython" / "ipython_config.py"
        expect_root_file(block, config, 0o644, REPO / "deploy" / "ipython_config.py")
        code = (
            "ip = get_ipython(); print('LOADED', 'gpushare_ext' in ip.extension_manager.loaded,"
            " 'gpu' in ip.magics_manager.magics['cell'])"
        )
        shown = run_command(
            as_user(STUDENT, str(self.bin / "python"), "-m", "IPython", "--no-banner", "-c", code),
            block,
        )
        if "LOADED True True" not in shown:
            raise failure(block, f"{STUDENT}'s IPython of {self.prefix} has no %%gpu: {shown}")

    def install_policy(self) -> None:
        """Step 7, then: root's 0644 copy of the example, which a root broker accepts."""
        block = self.prepared.block(7)
        self.run(block)
        expect_root_file(block, self.choices.config, 0o644, REPO / "deploy" / "broker.toml")
        run_command(
            [
                str(self.bin / "python"),
                "-c",
                "import sys; from gpushare_ext.broker.settings.config import load_config; "
                "load_config(sys.argv[1])",
                str(self.choices.config),
            ],
            block,
        )

    # -------------------------------------------------------------- steps 8 and 9

    def check_broker(self, runtime_dir: Path) -> None:
        """Step 8's promises once the broker answers: its socket for everyone, a sessions
        folder nobody else can list, and "Check it as any user" as a student."""
        block = self.prepared.background_block(8)
        socket_path = runtime_dir / "broker.sock"
        mode = stat.S_IMODE(socket_path.lstat().st_mode)
        if not stat.S_ISSOCK(socket_path.lstat().st_mode) or mode != 0o666:
            raise failure(block, f"{socket_path} is not a socket of mode 0666 ({mode:04o})")
        sessions = runtime_dir / "sessions"
        info = sessions.lstat()
        if info.st_uid != 0 or stat.S_IMODE(info.st_mode) & 0o044:
            mode = stat.S_IMODE(info.st_mode)
            raise failure(block, f"{sessions} can be listed by others (mode {mode:04o})")
        # Without any GPUSHARE_ variable: "the socket is found without configuration";
        # wide columns, so that a long host name does not wrap the title.
        env = {**environment_without_venv(), "COLUMNS": "200"}
        command = self.prepared.check_as_any_user
        shown = run_command(as_user(STUDENT, "bash", "-c", command.text), command, env=env)
        for expected in ("(system broker, simulated)", "NVIDIA H200"):
            if expected not in shown:
                raise failure(
                    command, f"`{command.text}` as {STUDENT} lacks {expected!r}:\n{shown}"
                )

    def write_hub_config(self) -> str:
        """Step 9 up to the hub's start: ``$HUB_CONFIG`` from the page's config (plus
        :data:`TEST_ONLY_HUB_SETTINGS`) and the fixed token's file; the token."""
        config = self.prepared.block(9, "python")
        self.choices.hub_config.write_text(
            config.text
            + TEST_ONLY_HUB_SETTINGS.format(
                hub_port=self.choices.hub_port, proxy_api_port=self.choices.proxy_api_port
            )
        )
        for block in self.prepared.bash_blocks(9):
            if not is_background(block):
                self.run(block)
        token_block = next(b for b in self.prepared.bash_blocks(9) if not is_background(b))
        folder, token_file = self.choices.hub_secrets, self.choices.token_file
        expect_root_mode(token_block, folder, 0o700)
        expect_root_mode(token_block, token_file, 0o600)
        token = token_file.read_text()
        if not re.fullmatch(r"[0-9a-f]{64}\n", token):
            raise failure(token_block, f"{token_file} holds no 64 hex digits: {token!r}")
        return token.strip()

    def check_hub_state(self) -> None:
        """The hub keeps its database and cookie secret in the root-only state folder."""
        block = self.prepared.background_block(9)
        expect_root_mode(block, self.choices.hub_state, 0o700)
        for name in ("jupyterhub.sqlite", "jupyterhub_cookie_secret"):
            if not (self.choices.hub_state / name).is_file():
                raise failure(block, f"the hub keeps no {name} in {self.choices.hub_state}")


# ------------------------------------------------------------------ small helpers


def users_script(block: Block, missing: dict[str, str]) -> str:
    """Step 5's block, its lines naming ``$USERNAME`` once for each user of ``missing``
    (name: group) after ``GROUP`` and ``USERNAME`` are set, as "for each user" says."""
    lines: list[str] = []
    for line in block.lines:
        if "$USERNAME" not in line:
            lines.append(line)
            continue
        for name, group in missing.items():
            lines += [f"GROUP={shlex.quote(group)}", f"USERNAME={shlex.quote(name)}", line]
    return "\n".join([*lines, ""])


def pinned_proxy_version(block: Block) -> str:
    pinned = re.search(r"configurable-http-proxy@([\d.]+)", block.text)
    if pinned is None:
        raise DocDrift(f"docs/deploy.md {block.name} no longer pins configurable-http-proxy")
    return pinned[1]


def proxy_version() -> str | None:
    try:
        done = subprocess.run(
            ["configurable-http-proxy", "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=environment_without_venv(),
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def groups_of(name: str) -> list[str]:
    done = subprocess.run(["id", "-nG", name], capture_output=True, text=True, check=False)
    return done.stdout.split()


def unreadable_by_others(top: Path) -> Iterable[Path]:
    """Folders others cannot enter or list, files they cannot read, programs they cannot run."""
    places = [top]
    for folder, folders, files in os.walk(top):
        places += [Path(folder, name) for name in (*folders, *files)]
    for path in places:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        needs = 0o005 if stat.S_ISDIR(mode) else 0o004 | (0o001 if mode & 0o100 else 0)
        if mode & needs != needs:
            yield path


def expect_root_mode(block: Block, path: Path, mode: int) -> None:
    try:
        info = path.lstat()
    except OSError:
        raise failure(block, f"{path} is missing") from None
    if info.st_uid != 0 or stat.S_IMODE(info.st_mode) != mode:
        raise failure(
            block,
            f"{path} is mode {stat.S_IMODE(info.st_mode):04o} of uid {info.st_uid}, "
            f"not root's {mode:04o}",
        )


def expect_root_file(block: Block, path: Path, mode: int, source: Path) -> None:
    expect_root_mode(block, path, mode)
    if path.read_bytes() != source.read_bytes():
        raise failure(block, f"{path} is not a copy of {source.relative_to(REPO)}")
