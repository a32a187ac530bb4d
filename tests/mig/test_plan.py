"""MIG planning: ``plan_layout`` proposes valid layouts, says what waits, prints the commands.

The layouts and demands are the shipped simulated H200s; nothing here runs nvidia-smi
(``--apply`` is only ever tried where it must be refused).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mig_helpers import GIB, device_of, devices_of
from msgspec.structs import replace

from gpushare_ext import mig_command
from gpushare_ext.broker.scheduler import mig
from gpushare_ext.broker.scheduler.mig import Demand, check_layout, plan_layout
from gpushare_ext.mig_command import plan_main
from gpushare_ext.protocol import DeviceView, LeaseState, LeaseView, Snapshot


def wants(*sizes_gib: float, running: bool = False) -> list[Demand]:
    return [
        Demand(memory_bytes=int(s * GIB), label=f"#{n + 1}", running=running)
        for n, s in enumerate(sizes_gib)
    ]


def names(plan) -> list[tuple[int, str]]:
    return [(i.start, i.profile.name) for i in plan.chosen.instances]


CASES = [
    # (layout, demand in GiB, leases served)
    ("h200", (8, 40, 40), 3),
    ("h200-mig-empty", (60, 20, 8, 8), 4),
    ("h200-mig-mixed", (8, 40), 2),
    ("h200-mig-7x1g", (8,) * 8, 8),
    ("h200-mig-fragmented", (60, 8, 8), 3),
    ("h200-mig-full", (100, 100), 1),
    ("h200-mig-empty", (150, 8), 1),
]


# ------------------------------------------------------------------ valid layouts


@pytest.mark.parametrize(("fixture", "sizes", "served"), CASES)
def test_every_candidate_is_a_valid_layout(fixture, sizes, served):
    device = device_of(fixture)

    plan = plan_layout(device, wants(*sizes))

    for candidate in plan.candidates:
        assert check_layout(device, candidate.instances) == [], candidate.name


@pytest.mark.parametrize(("fixture", "sizes", "served"), CASES)
def test_the_plan_serves_what_can_be_served(fixture, sizes, served):
    plan = plan_layout(device_of(fixture), wants(*sizes))

    assert plan.chosen.served == served
    assert len(plan.waiting) == len(sizes) - served
    for inst in plan.chosen.instances:
        asked = sum(plan.demand[i].memory_bytes for i in inst.serves)
        assert asked <= inst.memory_bytes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=150), min_size=0, max_size=10))
def test_any_demand_gives_valid_layouts_within_instance_counts(sizes):
    device = device_of("h200-mig-empty")

    plan = plan_layout(device, wants(*sizes))

    for candidate in plan.candidates:
        assert check_layout(device, candidate.instances) == []
        served = sorted(i for inst in candidate.instances for i in inst.serves)
        assert served == sorted(set(served))  # nobody is served twice
        assert sorted([*served, *candidate.waiting]) == list(range(len(sizes)))


def test_check_layout_names_what_breaks_the_rules():
    device = device_of("h200-mig-empty")
    profiles = {p.name: p for p in device.profiles}
    three_g, one_g = profiles["3g.71gb"], profiles["1g.18gb"]
    bad = [
        mig.PlannedInstance(profile=three_g, start=2),
        mig.PlannedInstance(profile=one_g, start=2),
        *(mig.PlannedInstance(profile=one_g, start=s) for s in range(3, 7)),
        mig.PlannedInstance(profile=one_g, start=6),
        mig.PlannedInstance(profile=one_g, start=0),
        mig.PlannedInstance(profile=one_g, start=1),
    ]

    problems = " / ".join(check_layout(device, bad))

    assert "3g.71gb may not start at memory slice 2" in problems
    assert "memory slice 2 is used by" in problems
    assert "8 × 1g.18gb, but at most 7 allowed" in problems
    assert "compute slices, but the device has 7" in problems


def test_seven_small_leases_fill_the_seven_one_slice_instances_and_no_more():
    plan = plan_layout(device_of("h200-mig-empty"), wants(*[4] * 7))

    assert names(plan) == [(s, "1g.18gb") for s in range(7)]
    assert plan.chosen.shared_leases == 0


def test_the_eighth_small_lease_shares_an_instance_rather_than_wait():
    plan = plan_layout(device_of("h200-mig-empty"), wants(*[8] * 8))

    assert plan.chosen.served == 8
    assert plan.chosen.shared_leases == 2
    assert "2 leases share an instance" in "\n".join(plan.explanation)


def test_a_sm_wish_picks_a_profile_with_enough_sms():
    device = device_of("h200-mig-empty")
    memory_only = plan_layout(device, [Demand(memory_bytes=8 * GIB)])
    with_sms = plan_layout(device, [Demand(memory_bytes=8 * GIB, sms=50)])

    assert names(memory_only) == [(0, "1g.18gb")]
    assert [i.profile.name for i in with_sms.chosen.instances] == ["3g.71gb"]


# ------------------------------------------------------------------ trade-offs


def test_fragmentation_is_explained_and_rebuilding_is_proposed():
    plan = plan_layout(device_of("h200-mig-fragmented"), wants(60, 8, 8))
    text = "\n".join(plan.explanation)

    assert plan.chosen.name == "best fit"
    assert plan.chosen.destroys_current
    assert "Not keep the current instances: it serves 2 lease(s) instead of 3" in text
    assert "The current instances must be destroyed first" in text


def test_a_layout_that_already_serves_the_demand_is_kept_and_needs_no_command():
    plan = plan_layout(device_of("h200-mig-mixed"), wants(8, 40))

    assert plan.chosen.name == "keep the current instances"
    assert plan.commands == ()
    assert "Every lease fits (2 of 2)." in plan.explanation


def test_isolation_beats_saving_memory_when_as_many_are_served():
    plan = plan_layout(device_of("h200-mig-empty"), wants(30, 30))
    text = "\n".join(plan.explanation)

    assert plan.chosen.shared_leases == 0
    assert "Not fewest instances: it serves no more and makes 2 leases share an instance" in text


def test_what_waits_is_named_with_the_reason():
    plan = plan_layout(device_of("h200-mig-empty"), wants(150, 8))
    text = "\n".join(plan.explanation)

    assert "1 of 2 leases fit; 1 would have to wait:" in text
    assert "#1 (150 GiB) waits: more than the largest profile (7g.141gb" in text
    assert "needs a whole GPU with MIG off" in text


def test_what_cannot_be_cut_beside_the_others_waits_with_that_reason():
    plan = plan_layout(device_of("h200-mig-full"), wants(100, 100, running=True))
    text = "\n".join(plan.explanation)

    assert "#2 (100 GiB) waits: no instance that holds it can be cut beside the others" in text
    assert "2 lease(s) run on GPU 0 now" in text


def test_waste_is_reported_in_memory_and_compute_slices():
    plan = plan_layout(device_of("h200-mig-empty"), wants(8))

    assert "Waste: 8.0 GiB of instance memory is not asked for; 6 of 7 compute slices" in (
        "\n".join(plan.explanation)
    )


def test_no_demand_means_nothing_to_plan():
    plan = plan_layout(device_of("h200-mig-mixed"), [])

    assert plan.commands == ()
    assert "Nothing to plan" in plan.explanation[0]


def test_no_demand_on_a_whole_gpu_asks_for_no_command():
    plan = plan_layout(device_of("h200"), [])

    assert plan.commands == ()
    assert mig.render_plan(plan) == plan.explanation[0]


def test_a_device_without_mig_profiles_cannot_be_planned():
    device = replace(device_of("h200"), profiles=())

    with pytest.raises(mig.MigPlanError, match="reports no MIG profiles"):
        plan_layout(device, wants(8))


# ------------------------------------------------------------------ commands


def test_commands_on_a_whole_gpu_enable_mig_then_create_largest_first():
    plan = plan_layout(device_of("h200"), wants(8, 60))

    assert plan.commands == (
        "nvidia-smi -i 0 -mig 1",
        "nvidia-smi mig -i 0 -cgi 2,0 -C",
    )


def test_commands_on_an_empty_mig_gpu_only_create():
    plan = plan_layout(device_of("h200-mig-empty"), wants(20, 20, 8))

    assert plan.commands == ("nvidia-smi mig -i 0 -cgi 9,9,0 -C",)


def test_commands_destroy_the_current_instances_before_creating():
    plan = plan_layout(device_of("h200-mig-7x1g"), wants(60))

    assert plan.commands == (
        "nvidia-smi mig -i 0 -dci",
        "nvidia-smi mig -i 0 -dgi",
        "nvidia-smi mig -i 0 -cgi 2 -C",
    )


def test_commands_name_the_planned_gpu():
    device = devices_of("h200-x2-mixed")[1]
    plan = plan_layout(device, wants(40))

    assert plan.commands == ("nvidia-smi -i 1 -mig 1", "nvidia-smi mig -i 1 -cgi 2 -C")


def test_keeping_the_current_instances_only_adds_to_the_free_slices():
    plan = plan_layout(device_of("h200-mig-fragmented"), wants(8, 8, 8))

    assert plan.chosen.name == "keep the current instances"
    assert plan.commands == ("nvidia-smi mig -i 0 -cgi 0 -C",)


# ------------------------------------------------------------------ the command line


def run(argv, capsys) -> tuple[int, str, str]:
    code = plan_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_offline_plan_prints_the_explanation_map_and_commands(capsys):
    code, out, err = run(["--simulate", "h200-mig-empty", "--demand", "60GiB,8GiB"], capsys)

    assert code == 0, err
    assert "Chosen layout: best fit" in out
    assert "Memory slices 0-7: |    3g.71gb    | 1g| . | . | . |" in out
    assert "  nvidia-smi mig -i 0 -cgi 2,0 -C" in out
    assert "simulated" in out


def test_json_output_carries_the_plan(capsys):
    code, out, _ = run(
        ["--simulate", "h200-x2", "--device", "1", "--demand", "40GiB:60sm", "--json"], capsys
    )

    data = json.loads(out)
    assert code == 0
    assert data["device_index"] == 1
    assert data["served"] == 1
    assert data["commands"] == ["nvidia-smi -i 1 -mig 1", "nvidia-smi mig -i 1 -cgi 2 -C"]
    assert data["demand"][0]["sms"] == 60


def test_apply_is_refused_on_a_simulated_inventory(capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("nvidia-smi must not run")

    monkeypatch.setattr(mig_command.subprocess, "run", never)

    code, out, err = run(["--simulate", "h200-mig-empty", "--demand", "8GiB", "--apply"], capsys)

    assert code == 1
    assert "Chosen layout" in out  # the plan is still shown
    assert "refusing --apply" in err
    assert "simulated" in err


def test_apply_is_refused_while_leases_run_on_the_device():
    real = replace(device_of("h200-mig-empty"), simulated=False)
    plan = plan_layout(real, wants(8, running=True))
    calls = []

    with pytest.raises(mig.MigPlanError, match="1 lease\\(s\\) run on GPU 0") as caught:
        mig_command.apply_plan(plan, run=lambda *a, **k: calls.append(a))
    assert "would kill their work" in str(caught.value)
    assert calls == []


def test_apply_runs_the_commands_in_order_on_an_idle_real_device():
    real = replace(device_of("h200-mig-7x1g"), simulated=False)
    plan = plan_layout(real, wants(60))
    ran = []

    class Done:
        returncode = 0
        stdout = stderr = ""

    done = mig_command.apply_plan(plan, run=lambda argv, **kw: ran.append(argv) or Done())

    assert done == list(plan.commands)
    assert ran[0] == ["nvidia-smi", "mig", "-i", "0", "-dci"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--simulate", "h200", "--demand", "8XB"], "'8XB' is not a size"),
        (["--simulate", "h200", "--demand", "8GiB,,4GiB"], "--demand item 2 is empty"),
        (["--simulate", "h200", "--demand", "8GiB:lots"], "'lots' is not a number of SMs"),
        (["--simulate", "h200", "--demand", "0GiB"], "asks for no memory"),
        (["--simulate", "h200", "--device", "3", "--demand", "8GiB"], "there is no device 3"),
        (["--simulate", "h200"], "--simulate needs --demand"),
        (
            ["--simulate", "h200", "--demand", "8GiB,8GiB:999sm"],
            "--demand item 2 asks for 999 SMs, more than GPU 0 (NVIDIA H200) has; "
            "ask for at most 132sm",
        ),
    ],
)
def test_bad_usage_gets_one_clear_line(argv, message, capsys):
    code, out, err = run(argv, capsys)

    assert code == 2
    assert out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_as_many_sms_as_the_gpu_has_are_still_planned(capsys):
    code, out, err = run(["--simulate", "h200", "--demand", "8GiB:132sm"], capsys)

    assert code == 0, err
    assert "#1 (8.0 GiB + 132 SMs)" in out


def test_with_no_lease_the_plan_is_the_one_sentence_nothing_to_plan(broker):
    result = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "mig", "plan", "--socket", str(broker)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "No lease asks for memory on GPU 0 (NVIDIA H200, simulated); MIG is off (the GPU is "
        "used whole). Nothing to plan.\n"
    )


def test_an_unknown_layout_lists_the_shipped_ones(capsys):
    code, _, err = run(["--simulate", "h200-nope", "--demand", "8GiB"], capsys)

    assert code == 1
    assert "h200-mig-mixed" in err


def test_without_a_broker_it_says_so_and_how_to_plan_offline(capsys, tmp_path):
    code, _, err = run(["--socket", str(tmp_path / "none.sock")], capsys)

    assert code == 1
    assert "no broker to ask" in err
    assert "--simulate NAME --demand SIZES" in err
    assert len(err.strip().splitlines()) == 1


def test_the_demand_is_read_from_the_brokers_leases(capsys, monkeypatch):
    device = device_of("h200-mig-mixed")
    small = next(i for i in device.instances if i.name == "1g.18gb")

    def lease(lease_id, state, where, mig_uuid, memory_gib, share=1.0):
        return LeaseView(lease_id=lease_id, user="u", own=False, priority=150, state=state,
                         device_index=where, mig_uuid=mig_uuid, memory_bytes=memory_gib * GIB,
                         sm_share=share, since_s=1.0, waited_s=0.0)  # fmt: skip

    snapshot = Snapshot(
        host="h", node="n", broker_pid=1, mode="user", inventory="simulated",
        inventory_description="", time=0.0, you="admin", is_admin=True,
        devices=[DeviceView(info=device, drained=False, memory_used_mib=0, memory_leased_mib=0,
                            utilization_pct=0, utilization_history=[], holders=[])],
        leases=[lease("L1", LeaseState.RUNNING, 0, small.uuid, 8, share=0.5),
                lease("L2", LeaseState.QUEUED, None, None, 100)],
        queue_by_priority={},
    )  # fmt: skip

    class FakeClient:
        def __init__(self, socket, client):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def status(self):
            return snapshot

    monkeypatch.setattr("gpushare_ext.client.BrokerClient", FakeClient)

    code, out, err = run(["--json", "--apply"], capsys)

    data = json.loads(out)
    assert [d["label"] for d in data["demand"]] == ["L1", "L2"]
    assert data["demand"][0]["sms"] == 8  # half of its 1g instance's 16 SMs
    assert data["running_leases"] == 1
    assert code == 1
    assert "refusing --apply" in err


def test_gpushare_mig_plan_forwards_its_options(capsys):
    from gpushare_ext.cli import main

    code = main(["mig", "plan", "--", "--simulate", "h200-mig-empty", "--demand", "8GiB"])

    assert code == 0
    assert "nvidia-smi mig -i 0 -cgi 0 -C" in capsys.readouterr().out


def test_gpushare_mig_plan_takes_options_without_a_separator(capsys):
    from gpushare_ext.cli import main

    code = main(["mig", "plan", "--simulate", "h200-mig-empty", "--demand", "8GiB"])

    assert code == 0
    assert "nvidia-smi mig -i 0 -cgi 0 -C" in capsys.readouterr().out
