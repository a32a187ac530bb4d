"""The ``gpushare`` command: run the broker, look at it, administer it, and tools around it.

Subcommands: ``broker``, ``status``, ``admin``, ``demo``, ``classify``, ``mig plan``.
Each validates its arguments and prints one clear line on error (exit status 2 for
bad usage, 1 for a failure, 0 for success).  Output into a pipe closed early
(``gpushare mig plan --json | head``) ends quietly with status 141, as a tool killed by
SIGPIPE does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gpushare_ext import __version__
from gpushare_ext.errors import GpushareError
from gpushare_ext.plain_text import plain_text

if TYPE_CHECKING:  # the commands import what they run when they run, to start quickly
    from gpushare_ext.broker.hands.inventory import InventoryBackend
    from gpushare_ext.broker.settings.config import BrokerConfig
    from gpushare_ext.paths import BrokerPaths


class _Parser(argparse.ArgumentParser):
    """A parser that reports arguments it does not know itself.

    argparse leaves a sub-command's unknown arguments to the top-level parser, which then
    shows the top-level usage; as each sub-parser is of this class (argparse makes them
    of the top-level parser's class), the error and usage are the sub-command's.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _add_socket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="broker socket (default: $GPUSHARE_SOCKET, else the system broker's if it exists "
        "($GPUSHARE_SYSTEM_SOCKET, else /run/gpushare/broker.sock), else this user's embedded "
        "broker)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpushare",
        description="Interactive shared-GPU sessions for Jupyter: broker, status and tools.",
    )
    parser.add_argument("--version", action="version", version=f"gpushare {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    broker = sub.add_parser(
        "broker",
        help="run the per-host broker in the foreground",
        description="Run the broker. User mode (default): a per-user socket under "
        "$XDG_RUNTIME_DIR/gpushare or /tmp/gpushare-UID. System mode (--system, as root): "
        "/run/gpushare/broker.sock, config /etc/gpushare/broker.toml, journal "
        "/var/lib/gpushare/journal.sqlite.",
    )
    source = broker.add_mutually_exclusive_group()
    source.add_argument(
        "--simulate",
        metavar="FILE|NAME",
        help="serve a simulated inventory: a JSON file in the fixture format or a shipped "
        "fixture name (h200, h200-x2, h200-mig-mixed, ...); no GPU is used",
    )
    source.add_argument(
        "--inventory",
        choices=["auto", "nvml"],
        help="auto (default): NVML if it initialises, else the simulated H200; nvml: fail without a GPU",
    )
    broker.add_argument(
        "--system", action="store_true", help="system mode (root, shared by all users)"
    )
    broker.add_argument(
        "--socket",
        metavar="PATH",
        help="where to listen, in a folder that exists (default: the mode's socket above, or "
        "broker.socket in the config)",
    )
    broker.add_argument(
        "--config",
        metavar="PATH",
        help="TOML config and policy (system default /etc/gpushare/broker.toml)",
    )
    broker.add_argument("--journal", metavar="PATH", help="SQLite journal path")
    broker.add_argument(
        "--devices",
        metavar="LIST",
        help="GPU indices to manage, e.g. 0 or 0,1 (default: all; also $GPUSHARE_DEVICES)",
    )
    broker.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on PORT of broker.metrics_address (default 127.0.0.1); "
        "broker.metrics_token_file makes scrapers send a bearer token",
    )
    broker.add_argument(
        "--exit-when-idle",
        metavar="DURATION",
        help="exit after no notebook session and no lease for this long, e.g. 10m (the "
        "embedded broker a %%%%gpu cell starts uses 10m; default: run until stopped)",
    )
    broker.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )

    status = sub.add_parser("status", help="show devices, MIG layout, leases and queue")
    _add_socket(status)
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")

    admin = sub.add_parser(
        "admin", help="drain/undrain a device, cancel a lease, reload policy (admins)"
    )
    _add_socket(admin)
    admin.add_argument(
        "action", choices=["drain", "undrain", "cancel", "reload-policy", "set-policy"]
    )
    admin.add_argument(
        "target",
        nargs="?",
        help="device index (drain/undrain), lease id (cancel) or TOML file (set-policy)",
    )

    park = sub.add_parser(
        "park",
        help="park an idle notebook now: its GPU memory goes to host memory until its next cell",
        description="Checkpoints the GPU memory of an idle notebook (yours; anyone's for "
        "admins) to host memory, so others can use the GPU; the notebook restores it by "
        "itself before its next cell.",
    )
    _add_socket(park)
    park.add_argument("pid", help="the notebook kernel's process id (gpushare status shows it)")

    chaos = sub.add_parser(
        "chaos",
        help="pause a notebook at random moments, to see whether its code survives (admins)",
        description="Has the broker pause the session of PID at random moments: every EVERY "
        "milliseconds (a random gap in the range) for PAUSE milliseconds, at one of LEVELS "
        "(0 gate, 1 yield, 2 abort, 3 lock, 4 evict; only those the GPU allows for that "
        "process are used), until --for seconds have passed or `gpushare chaos PID --stop`. "
        "Results after any number of pauses must be those of an undisturbed run.",
    )
    _add_socket(chaos)
    chaos.add_argument("pid", help="the notebook kernel's process id (gpushare status shows it)")
    chaos.add_argument("--every", default="5-50", metavar="MS-MS", help="gap between pauses")
    chaos.add_argument("--pause", default="1-20", metavar="MS-MS", help="length of a pause")
    chaos.add_argument("--levels", default="0,1,3", help="ladder levels to pause at")
    chaos.add_argument("--for", dest="duration", type=float, metavar="SECONDS", help="then stop")
    chaos.add_argument("--seed", type=int, default=0, help="the same seed replays the same pauses")
    chaos.add_argument("--stop", action="store_true", help="stop pausing PID and say how it went")

    demo = sub.add_parser(
        "demo",
        help="two notebook sessions contend for one GPU on an embedded broker",
        description="Starts an embedded broker (real GPU if NVML works, else the simulated H200), "
        "runs two real notebook kernels -- a low-priority training loop and a high-priority "
        "interactive cell -- and prints who waited, who was preempted and the timings.",
    )
    demo.add_argument(
        "--simulate", metavar="FILE|NAME", help="use a simulated inventory even if a GPU is present"
    )
    demo.add_argument(
        "--steps", type=int, default=40, help="training-loop steps of the low-priority session"
    )
    demo.add_argument(
        "--out", metavar="DIR", help="keep the executed notebooks and a JSON timeline here"
    )

    classify = sub.add_parser(
        "classify",
        help="classify kernels of a .cu or .ptx file as idempotent or not",
        add_help=False,
    )
    classify.add_argument("rest", nargs=argparse.REMAINDER)

    mig = sub.add_parser("mig", help="MIG tools")
    mig_sub = mig.add_subparsers(dest="mig_command", metavar="SUBCOMMAND")
    mig_sub.required = True
    plan = mig_sub.add_parser(
        "plan", help="propose a MIG layout for the current demand", add_help=False
    )
    plan.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


# What a shell reports for a command killed by SIGPIPE (128 + 13).  Python ignores the
# signal and raises BrokenPipeError instead; exiting with the signal's status keeps
# ``set -o pipefail`` scripts telling a closed pipe from a real failure (status 1).
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """The command line's entry point: :func:`run_command` with a closed stdout made quiet."""
    try:
        try:
            return run_command(argv)
        finally:
            # Buffered output goes now, while a closed pipe can still be caught, and
            # not in the interpreter's exit, where it would print "Exception ignored".
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader has gone: nothing more can reach it.  Standard output is pointed at
        # /dev/null so the interpreter's own flush at exit finds nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def run_command(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command it names; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # These subcommands own their options (their --help included): hand them the rest.
    if argv[:1] == ["classify"]:
        from gpushare_ext.kernels.cli import classify_main

        return classify_main(argv[1:])
    if argv[:2] == ["mig", "plan"]:
        from gpushare_ext.mig_command import plan_main

        return plan_main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "broker":
            return _cmd_broker(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "admin":
            return _cmd_admin(args)
        if args.command == "park":
            return _cmd_park(args)
        if args.command == "chaos":
            return _cmd_chaos(args)
        if args.command == "demo":
            from gpushare_ext.demo import run_demo

            return run_demo(simulate=args.simulate, steps=args.steps, out=args.out)
        if args.command == "classify":
            from gpushare_ext.kernels.cli import classify_main

            return classify_main(args.rest)
        if args.command == "mig":
            from gpushare_ext.mig_command import plan_main

            return plan_main(args.rest)
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


#: The most characters of one error line (a path or a policy key may make it long).
_FAILURE_LIMIT = 2000


def _fail(message: str, code: int = 1) -> int:
    # Refusals quote what files, brokers and other users wrote (a policy's keys, a
    # path): one line of plain text, whatever is in it, never an escape sequence.
    print(f"gpushare: {plain_text(message, limit=_FAILURE_LIMIT)}", file=sys.stderr)
    return code


def _broker_overrides(args: argparse.Namespace) -> tuple[dict, str]:
    """Settings the command line (and ``$GPUSHARE_DEVICES``) puts over the config file,
    or a one-line refusal."""
    overrides: dict = {}
    if args.journal:
        overrides["journal"] = args.journal
    devices_text = args.devices or os.environ.get("GPUSHARE_DEVICES")
    if devices_text:
        try:
            overrides["devices"] = [int(part) for part in devices_text.split(",") if part.strip()]
        except ValueError:
            return {}, f"--devices {devices_text!r} is not a list of GPU indices like 0,1"
    if args.metrics_port is not None:
        if not 0 < args.metrics_port < 65536:
            return {}, f"--metrics-port {args.metrics_port} is not a port number"
        overrides["metrics_port"] = args.metrics_port
    return overrides, ""


def _socket_refusal(socket: str | None, mode: str) -> str:
    """Why an explicit ``--socket`` cannot be used, or "".

    The broker makes its own runtime folder, but a folder someone named that is missing
    is most likely a typo: creating it would hide the mistake and leave stray folders.
    """
    if socket is None:
        return ""
    from gpushare_ext.paths import broker_paths

    folder = Path(os.path.abspath(socket)).parent
    default = broker_paths(mode).runtime_dir
    if folder.exists() or folder == Path(os.path.abspath(default)):
        return ""
    return (
        f"--socket {socket}: the folder {folder} does not exist; create it first, or leave "
        f"--socket out to use {default}"
    )


class _Refused(GpushareError):
    """A one-line reason the broker cannot start, and the exit status to end with."""

    code = "refused"

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def _broker_config_file(
    args: argparse.Namespace, paths: BrokerPaths
) -> tuple[BrokerConfig, str | None]:
    """The configuration (``--config``, else the mode's file where there is one) and its
    path."""
    from gpushare_ext.broker.settings.config import load_config
    from gpushare_ext.broker.settings.policy import PolicyError

    config_path = args.config or (
        str(paths.config) if paths.config and paths.config.exists() else None
    )
    try:
        return load_config(config_path), config_path
    except PolicyError as exc:
        raise _Refused(str(exc)) from None


def _exit_when_idle_seconds(args: argparse.Namespace) -> float | None:
    if args.exit_when_idle is None:
        return None
    from gpushare_ext.units import parse_duration

    try:
        return parse_duration(args.exit_when_idle)
    except ValueError as exc:
        raise _Refused(f"--exit-when-idle {args.exit_when_idle!r}: {exc}", 2) from None


def _broker_inventory(
    args: argparse.Namespace, config: BrokerConfig
) -> tuple[InventoryBackend, str | None]:
    """The GPUs to serve (``--simulate``, ``--inventory``, else the config's), and a note
    about them; what is opened is said on stderr when it is not the real host's."""
    from gpushare_ext.broker.hands.inventory import InventoryError, open_inventory

    spec = args.simulate or args.inventory or config.inventory
    try:
        inventory, note = open_inventory(spec)
    except InventoryError as exc:
        if args.simulate:  # a name or file the user typed: usage, as for the demo
            raise _Refused(f"--simulate: {exc}", 2) from None
        raise _Refused(str(exc)) from None
    if note:
        print(f"gpushare broker: {note}", file=sys.stderr)
    if inventory.kind == "simulated":
        print(f"gpushare broker: SIMULATED GPU -- {inventory.description}", file=sys.stderr)
    return inventory, note


def _cmd_broker(args: argparse.Namespace) -> int:
    from gpushare_ext.broker.edges.server import run_broker
    from gpushare_ext.paths import broker_paths

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    mode = "system" if args.system else "user"
    if args.system and os.geteuid() != 0:
        return _fail("system mode needs root (it serves every user of the host)")
    refusal = _socket_refusal(args.socket, mode)
    if refusal:
        return _fail(refusal, 2)
    paths = broker_paths(mode, args.socket)
    try:
        config, config_path = _broker_config_file(args, paths)
        overrides, refusal = _broker_overrides(args)
        if refusal:
            return _fail(refusal, 2)
        exit_when_idle_s = _exit_when_idle_seconds(args)
        if overrides:
            from dataclasses import replace

            config = replace(config, **overrides)
        if args.socket is None and config.socket:
            paths = broker_paths(mode, config.socket)
        inventory, note = _broker_inventory(args, config)
    except _Refused as refused:
        return _fail(refused.message, refused.exit_status)
    try:
        asyncio.run(
            run_broker(
                config,
                paths,
                inventory,
                note,
                config_path=Path(config_path).resolve() if config_path else None,
                exit_when_idle_s=exit_when_idle_s,
            )
        )
    except RuntimeError as exc:
        return _fail(str(exc))
    return 0


def _how_to_start_a_broker(socket_path: Path, chosen: bool) -> str:
    """The fix for ``gpushare status`` finding no broker on ``socket_path``, in a sentence.

    A ``%%gpu`` cell starts an embedded broker only on this user's default socket, and
    ``gpushare broker`` listens there unless told otherwise, so a socket ``chosen`` by
    ``--socket`` or ``$GPUSHARE_SOCKET`` gets the broker command with that ``--socket``.
    """
    import shlex

    from gpushare_ext.paths import (
        SYSTEM_SOCKET,
        how_a_broker_starts,
        system_socket,
        user_runtime_dir,
    )

    if socket_path in (SYSTEM_SOCKET, system_socket()):
        return how_a_broker_starts(socket_path)
    if not chosen and socket_path == user_runtime_dir() / "broker.sock":
        return (
            "Start one with `gpushare broker`, or run a `%%gpu` cell in a notebook, "
            "which starts one for you"
        )
    return f"Start one there with `gpushare broker --socket {shlex.quote(str(socket_path))}`"


def _cmd_status(args: argparse.Namespace) -> int:
    from gpushare_ext.client import BrokerClient, BrokerError, BrokerUnavailable
    from gpushare_ext.paths import default_socket_path
    from gpushare_ext.protocol import snapshot_to_builtins
    from gpushare_ext.status_view import render_status

    socket_path = Path(args.socket) if args.socket else default_socket_path()
    try:
        with BrokerClient(socket_path, client="cli") as client:
            snapshot = client.status()
    except BrokerUnavailable as exc:
        if not exc.message.startswith("no broker is listening"):  # e.g. a permission denied
            return _fail(str(exc))
        chosen = bool(args.socket or os.environ.get("GPUSHARE_SOCKET"))
        return _fail(f"{exc}. {_how_to_start_a_broker(socket_path, chosen)}.")
    except BrokerError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(snapshot_to_builtins(snapshot), indent=2))
    else:
        render_status(snapshot)
    return 0


def _cmd_park(args: argparse.Namespace) -> int:
    from gpushare_ext.client import BrokerClient, BrokerError

    if not (args.pid.isascii() and args.pid.isdecimal()) or int(args.pid) < 1:
        return _fail(f"park needs a process id, e.g. gpushare park 4242 (not {args.pid!r})", 2)
    try:
        with BrokerClient(args.socket, client="cli") as client:
            print(client.park(int(args.pid)))
    except BrokerError as exc:
        return _fail(str(exc))
    return 0


def _milliseconds(text: str, what: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    try:
        bounds = (float(low), float(high or low))
    except ValueError:
        raise ValueError(f"--{what} takes milliseconds like 5-50 or 10, not {text!r}") from None
    return bounds


def _cmd_chaos(args: argparse.Namespace) -> int:
    from gpushare_ext.client import BrokerClient, BrokerError

    if not (args.pid.isascii() and args.pid.isdecimal()) or int(args.pid) < 1:
        return _fail(f"chaos needs a process id, e.g. gpushare chaos 4242 (not {args.pid!r})", 2)
    try:
        every = _milliseconds(args.every, "every")
        pause = _milliseconds(args.pause, "pause")
        levels = tuple(int(part) for part in args.levels.split(",") if part.strip())
    except ValueError as exc:
        message = (
            str(exc)
            if "takes" in str(exc)
            else f"--levels takes levels like 0,1,3, not {args.levels!r}"
        )
        return _fail(message, 2)
    if not levels or any(not 0 <= level <= 4 for level in levels):
        return _fail(
            f"--levels takes ladder levels from 0 to 4, like 0,1,3, not {args.levels!r}", 2
        )
    try:
        with BrokerClient(args.socket, client="cli") as client:
            print(
                client.chaos(
                    int(args.pid), every_ms=every, pause_ms=pause, levels=levels,
                    duration_s=args.duration, seed=args.seed, stop=args.stop,
                )
            )  # fmt: skip
    except BrokerError as exc:
        return _fail(str(exc))
    return 0


def _cmd_admin(args: argparse.Namespace) -> int:
    from gpushare_ext.client import BrokerClient, BrokerError

    action = args.action.replace("-", "_")
    kwargs: dict = {}
    if action in ("drain", "undrain"):
        if args.target is None or not (args.target.isascii() and args.target.isdecimal()):
            return _fail(
                f"{args.action} needs a device index, e.g. gpushare admin {args.action} 0", 2
            )
        kwargs["device"] = int(args.target)
    elif action == "cancel":
        if not args.target:
            return _fail("cancel needs a lease id, e.g. gpushare admin cancel L12", 2)
        kwargs["lease_id"] = args.target
    elif action == "set_policy":
        if not args.target:
            return _fail("set-policy needs a TOML file", 2)
        try:
            kwargs["policy_toml"] = Path(args.target).read_text()
        except OSError as exc:
            return _fail(f"cannot read {args.target}: {exc.strerror}")
    try:
        with BrokerClient(args.socket, client="cli") as client:
            detail = client.admin(action, **kwargs)
    except BrokerError as exc:
        return _fail(str(exc))
    print(detail or "done")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
