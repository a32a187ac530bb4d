"""Policy and config files: what an admin writes, and the errors a typo gets."""

from __future__ import annotations

import pytest

from gpushare_ext.broker.settings.config import load_config, parse_config
from gpushare_ext.broker.settings.policy import (
    GIB,
    Limits,
    PolicyError,
    StopCause,
    VictimTraits,
    format_size,
    ladder_level,
    parse_policy,
    parse_size,
    stopping_level,
)
from gpushare_ext.protocol import PreemptionLevel, SliceWish

# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * GIB),
        ("8 gib", 8 * GIB),
        ("8G", 8 * GIB),
        ("512MiB", 512 * 1024**2),
        ("512MB", 512 * 1000**2),
        ("2GB", 2 * 1000**3),
        ("1.5G", int(1.5 * GIB)),
        ("1TiB", 1024**4),
        ("4096", 4096),
        ("100B", 100),
        (1024, 1024),
    ],
)
def test_sizes_are_read_the_way_people_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["eight", "8 XB", "-1GiB", "", "GiB", -5, True])
def test_bad_sizes_are_refused_with_a_reason(text):
    with pytest.raises(ValueError) as raised:
        parse_size(text)
    assert str(raised.value)


def test_sizes_are_shown_in_binary_units():
    assert format_size(8 * GIB) == "8.0 GiB"
    assert format_size(143771 * 1024**2) == "140 GiB"
    assert format_size(512) == "512 B"


# ------------------------------------------------------------------ policy files


def test_an_unknown_setting_is_named_with_its_section():
    with pytest.raises(PolicyError) as raised:
        parse_policy('[defaults]\nmemory_qouta = "8GiB"\n')
    message = str(raised.value)
    assert "defaults.memory_qouta" in message  # the section and the key, together
    assert "memory_quota" in message  # the known settings are listed


def test_an_unknown_setting_in_a_group_is_named_with_the_group():
    with pytest.raises(PolicyError) as raised:
        parse_policy("[groups.students]\nmax_prio = 3\n")
    assert "groups.students" in str(raised.value) and "max_prio" in str(raised.value)


def test_an_unknown_section_is_named():
    with pytest.raises(PolicyError) as raised:
        parse_policy("[defualts]\nmax_leases = 2\n")
    assert "defualts" in str(raised.value)


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ('[defaults]\nmax_priority = "urgent"\n', "defaults.max_priority"),
        ("[defaults]\nmax_priority = 300\n", "defaults.max_priority"),
        ('[users.alice]\nmemory_quota = "lots"\n', "users.alice.memory_quota"),
        ("[defaults]\nmax_leases = 0\n", "defaults.max_leases"),
        ("[defaults]\naging_per_minute = -1\n", "defaults.aging_per_minute"),
        ('[defaults]\nslice = "half"\n', "defaults.slice"),
        ('[broker]\nsharing = "fair"\n', "broker.sharing"),
        ("[defaults\n", "not valid TOML"),
    ],
)
def test_bad_values_name_the_key(toml, words):
    with pytest.raises(PolicyError) as raised:
        parse_policy(toml)
    assert words in str(raised.value)


POLICY = """
[broker]
admin_groups = ["gpuadmin"]
admin_users = ["hubadmin"]

[defaults]
max_priority = "high"
memory_quota = "40GiB"
default_memory = "8GiB"
max_leases = 4
aging_per_minute = 10
slice = "auto"

[groups.students]
max_priority = "normal"
memory_quota = "16GiB"
max_leases = 2

[groups.staff]
memory_quota = "32GiB"
slice = "shared"

[users.alice]
max_priority = "high"
max_leases = 6
"""


def test_a_user_without_sections_gets_the_defaults():
    limits = parse_policy(POLICY).limits_for("carol", ())
    assert limits == Limits(
        max_priority=250, memory_quota=40 * GIB, default_memory=8 * GIB, max_leases=4,
        aging_per_minute=10.0, slice=SliceWish.AUTO,
    )  # fmt: skip


def test_a_group_overrides_the_defaults_and_the_user_section_overrides_the_group():
    policy = parse_policy(POLICY)
    student = policy.limits_for("bob", ("students",))
    assert (student.max_priority, student.memory_quota, student.max_leases) == (150, 16 * GIB, 2)
    alice = policy.limits_for("alice", ("students",))
    assert (alice.max_priority, alice.memory_quota, alice.max_leases) == (250, 16 * GIB, 6)


def test_groups_apply_in_file_order_whatever_order_the_user_is_in_them():
    # The docstring promises "each of their groups in file order": staff comes after
    # students in the file, so its memory quota wins, however getgrouplist orders them.
    policy = parse_policy(POLICY)
    for groups in (("students", "staff"), ("staff", "students")):
        limits = policy.limits_for("dan", groups)
        assert limits.memory_quota == 32 * GIB, groups
        assert limits.max_priority == 150  # staff says nothing about priority
        assert limits.slice == SliceWish.SHARED


def test_admins_are_root_the_named_users_and_members_of_admin_groups():
    policy = parse_policy(POLICY)
    assert policy.is_admin(0, "root", ())
    assert policy.is_admin(1001, "hubadmin", ())
    assert policy.is_admin(1002, "eve", ("users", "gpuadmin"))
    assert not policy.is_admin(1003, "bob", ("students",))


# ------------------------------------------------------------------ broker config


def test_the_broker_table_is_read_with_the_policy():
    config = parse_config(
        POLICY.replace(
            "[broker]\n", '[broker]\nmax_requests_per_second = 5\nsharing = "exclusive"\n'
        )
    )
    assert config.max_requests_per_second == 5
    assert config.policy.sharing == "exclusive"
    assert config.policy.admin_groups == ("gpuadmin",)


def test_an_unknown_broker_key_is_named():
    with pytest.raises(PolicyError) as raised:
        parse_config("[broker]\nmax_request_per_second = 5\n", "broker.toml")
    message = str(raised.value)
    assert "broker.toml" in message and "broker.max_request_per_second" in message
    assert "max_requests_per_second" in message


@pytest.mark.parametrize(
    "line", ['metrics_port = "9400"', "max_connections_per_uid = true", "reclaim_grace_s = []"]
)
def test_a_broker_key_of_the_wrong_type_is_named(line):
    with pytest.raises(PolicyError) as raised:
        parse_config(f"[broker]\n{line}\n", "broker.toml")
    assert f"broker.{line.split()[0]}" in str(raised.value)


def test_a_missing_config_file_is_a_policy_error_naming_it(tmp_path):
    with pytest.raises(PolicyError) as raised:
        load_config(tmp_path / "nope.toml")
    assert "nope.toml" in str(raised.value)


# ------------------------------------------------------------------ ladder choice


@pytest.mark.parametrize(
    ("traits", "level"),
    [
        (dict(gate=True, yield_flag=True, instrumented_only=True, lockable=True), "YIELD"),
        # The gate holds only launches not yet issued: without a flag, lock.
        (dict(gate=True, yield_flag=False, instrumented_only=True, lockable=True), "LOCK"),
        (dict(gate=True, yield_flag=True, instrumented_only=False, lockable=True), "LOCK"),
        (dict(gate=False, yield_flag=False, instrumented_only=False, lockable=True), "LOCK"),
        # An MPS client cannot be locked: the gate is the best that is left.
        (dict(gate=True, yield_flag=False, instrumented_only=False, lockable=False), "GATE"),
        (dict(gate=False, yield_flag=False, instrumented_only=False, lockable=False), None),
    ],
)
def test_the_cheapest_level_that_stops_all_work_is_chosen(traits, level):
    chosen = stopping_level(VictimTraits(evictable=True, **traits))
    assert chosen == (PreemptionLevel[level] if level else None)


YIELDS = VictimTraits(
    gate=True, yield_flag=True, instrumented_only=True, lockable=True, evictable=True
)
LOCKS = VictimTraits(
    gate=True, yield_flag=False, instrumented_only=False, lockable=True, evictable=True
)
MPS = VictimTraits(
    gate=False, yield_flag=False, instrumented_only=False, lockable=False, evictable=True
)


@pytest.mark.parametrize(
    ("cause", "stopping", "applied", "level"),
    [
        # Making room: the highest level any of the gang's running ranks needs.
        (StopCause.MAKE_ROOM, [YIELDS], None, PreemptionLevel.YIELD),
        (StopCause.MAKE_ROOM, [YIELDS, LOCKS], None, PreemptionLevel.LOCK),
        (StopCause.MAKE_ROOM, [YIELDS, MPS], None, None),
        # What was applied before a restart is asked for again, whatever the traits.
        (StopCause.MAKE_ROOM, [YIELDS], PreemptionLevel.EVICT, PreemptionLevel.EVICT),
        (StopCause.FREE_MEMORY, [YIELDS], None, PreemptionLevel.EVICT),
        # The watchdog locks, or leaves running what cannot be locked.
        (StopCause.OVER_QUOTA, [YIELDS], None, PreemptionLevel.LOCK),
        (StopCause.OVER_QUOTA, [MPS], None, None),
    ],
)
def test_one_function_chooses_the_ladder_level_for_every_cause(cause, stopping, applied, level):
    assert ladder_level(cause, stopping, applied) == level
