"""``gpushare mig plan``: the thin command around the MIG planner (``broker/scheduler/mig.py``).

What it is for: reading the arguments, asking the broker for the inventory and the
leases (or loading a simulated inventory), printing the plan or its JSON, and with
``--apply`` running the ``nvidia-smi`` commands, only where ``check_can_apply`` allows.

What it must not do: plan anything itself (the planner is pure and tested on its own),
or apply a plan the planner refused.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence

from gpushare_ext.broker.hands.inventory import (
    DeviceInfo,
    InventoryError,
    SimulatedInventory,
    shipped_fixtures,
)
from gpushare_ext.broker.scheduler.mig import (
    MigPlanError,
    Plan,
    check_can_apply,
    check_demand_fits,
    demand_from_snapshot,
    parse_demand,
    plan_layout,
    plan_to_builtins,
    render_plan,
)

__all__ = ["apply_plan", "build_plan_parser", "plan_main"]


def apply_plan(plan: Plan, run=subprocess.run) -> list[str]:
    """Run the plan's commands in order, stopping at the first failure; return what ran."""
    check_can_apply(plan)
    done = []
    for command in plan.commands:
        result = run(shlex.split(command), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            detail = (result.stderr or result.stdout or "").strip().splitlines()
            raise MigPlanError(
                f"{command!r} failed ({detail[-1] if detail else f'exit {result.returncode}'}); "
                f"already ran: {done or 'nothing'}"
            )
        done.append(command)
    return done


def build_plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpushare mig plan",
        description="Propose a MIG layout for the current demand, explain the trade-off and "
        "print the nvidia-smi commands an admin would run. Nothing is changed unless --apply "
        "is given; --apply is refused on a simulated inventory and while any lease runs on "
        "the device.",
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="broker socket to read the inventory and the leases from (default: as gpushare "
        "status)",
    )
    parser.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="device index to plan (default: the first device with MIG on, else device 0)",
    )
    parser.add_argument(
        "--demand",
        metavar="SIZES",
        help="plan for these leases instead of the broker's: sizes separated by commas, each "
        "optionally with SMs, e.g. 8GiB,40GiB:60sm",
    )
    parser.add_argument(
        "--simulate",
        metavar="NAME|FILE",
        help="plan offline for a simulated inventory (a shipped fixture such as "
        "h200-mig-mixed, or a JSON file); needs --demand, no broker is asked",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--apply",
        action="store_true",
        help="run the commands (as root); refused on a simulated inventory and while leases run",
    )
    return parser


def _pick_device(devices: Sequence[DeviceInfo], wanted: int | None) -> DeviceInfo:
    by_index = {d.index: d for d in devices}
    if wanted is None:
        mig_on = [d for d in devices if d.mig_enabled]
        return mig_on[0] if mig_on else min(devices, key=lambda d: d.index)
    if wanted not in by_index:
        raise MigPlanError(
            f"there is no device {wanted} (devices: {sorted(by_index)})", exit_code=2
        )
    return by_index[wanted]


def plan_main(argv: list[str]) -> int:
    """``gpushare mig plan``: 0 on success, 1 on a failure, 2 on bad usage."""
    parser = build_plan_parser()
    argv = list(argv)
    if argv[:1] == ["--"]:  # ``gpushare mig plan -- --demand ...`` passes the separator on
        argv = argv[1:]
    args = parser.parse_args(argv)
    try:
        demand = parse_demand(args.demand) if args.demand is not None else None
        running: int | None = None
        if args.simulate:
            if demand is None:
                raise MigPlanError(
                    "--simulate needs --demand: there is no broker to read the leases from "
                    "(example: --demand 8GiB,40GiB)",
                    exit_code=2,
                )
            try:
                devices = SimulatedInventory(args.simulate).devices()
            except InventoryError as exc:
                raise MigPlanError(str(exc)) from exc
            device = _pick_device(devices, args.device)
        else:
            from gpushare_ext.client import BrokerClient, BrokerError

            try:
                with BrokerClient(args.socket, client="cli") as client:
                    snapshot = client.status()
            except BrokerError as exc:
                raise MigPlanError(
                    f"no broker to ask ({exc}); start one, or plan offline with "
                    f"--simulate NAME --demand SIZES (fixtures: {', '.join(shipped_fixtures())})"
                ) from exc
            device = _pick_device([view.info for view in snapshot.devices], args.device)
            leases, running = demand_from_snapshot(snapshot, device)
            if demand is None:
                demand = leases
        if args.demand is not None:  # a lease read from the broker asks for a share of SMs
            check_demand_fits(device, demand)
        plan = plan_layout(device, demand, running_leases=running)
        if args.json:
            print(json.dumps(plan_to_builtins(plan), indent=2))
        else:
            print(render_plan(plan))
        if args.apply:
            for command in apply_plan(plan):
                print(f"ran: {command}")
            print("Applied. Restart the broker so it reads the new instances.")
    except MigPlanError as exc:
        print(f"gpushare mig plan: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
