"""The broker's config file as an admin meets it: every wrong value is refused with one
line naming the file, the key and the value; every right one is read as written; a
reload tells which changed keys need a restart; and docs/policy.md says what the schema
says."""

from __future__ import annotations

import grp
import os
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from gpushare_ext.broker.settings import schema
from gpushare_ext.broker.settings.config import (
    BrokerConfig,
    load_config,
    parse_config,
    restart_needed,
)
from gpushare_ext.broker.settings.policy import (
    GIB,
    HostShare,
    Limits,
    Policy,
    PolicyError,
    parse_policy,
)
from gpushare_ext.protocol import SliceWish

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "deploy" / "broker.toml"
MIB = 1024**2
NO_SUCH_GROUP = "gpushare-no-such-group-7f3a"


def existing_group() -> str:
    try:
        return grp.getgrgid(os.getgid()).gr_name
    except KeyError:
        groups = grp.getgrall()
        if not groups:
            pytest.skip("this host's group database is empty")
        return groups[0].gr_name


def refusal_of(text: str | bytes) -> PolicyError:
    with pytest.raises(PolicyError) as raised:
        parse_config(text, "broker.toml")
    message = str(raised.value)
    assert "\n" not in message and "\r" not in message, message
    return raised.value


# ------------------------------------------------------------------ wrong values

# (TOML text, the dotted key named, the value as the message shows it)
WRONG = [
    ("[broker]\nmax_connections_per_uid = -1", "broker.max_connections_per_uid", "-1"),
    ("[broker]\nmax_connections_per_uid = 0", "broker.max_connections_per_uid", "0"),
    ("[broker]\nmax_connections_per_uid = 100001", "broker.max_connections_per_uid", "100001"),
    ("[broker]\nmax_connections_per_uid = true", "broker.max_connections_per_uid", "true"),
    ("[broker]\nmax_requests_per_second = 0", "broker.max_requests_per_second", "0"),
    ("[broker]\nmax_requests_per_second = -5", "broker.max_requests_per_second", "-5"),
    ("[broker]\nmax_requests_per_second = nan", "broker.max_requests_per_second", "nan"),
    ("[broker]\nmax_requests_per_second = inf", "broker.max_requests_per_second", "inf"),
    ("[broker]\nmax_requests_per_second = 2e6", "broker.max_requests_per_second", "2000000.0"),
    ("[broker]\nmax_requests_per_second = true", "broker.max_requests_per_second", "true"),
    ("[broker]\nreclaim_grace_s = -10", "broker.reclaim_grace_s", "-10"),
    ("[broker]\nreclaim_grace_s = nan", "broker.reclaim_grace_s", "nan"),
    ("[broker]\nreclaim_grace_s = 86401", "broker.reclaim_grace_s", "86401"),
    ("[broker]\nreclaim_grace_s = []", "broker.reclaim_grace_s", "[]"),
    ("[broker]\nlock_timeout_ms = -1", "broker.lock_timeout_ms", "-1"),
    ("[broker]\nlock_timeout_ms = 0", "broker.lock_timeout_ms", "0"),
    ("[broker]\nlock_timeout_ms = 2.5", "broker.lock_timeout_ms", "2.5"),
    ("[broker]\nlock_timeout_ms = 600001", "broker.lock_timeout_ms", "600001"),
    ("[broker]\ngrant_after_stops_ms = -1", "broker.grant_after_stops_ms", "-1"),
    ("[broker]\ngrant_after_stops_ms = 60001", "broker.grant_after_stops_ms", "60001"),
    ("[broker]\nmetrics_port = 0", "broker.metrics_port", "0"),
    ("[broker]\nmetrics_port = 70000", "broker.metrics_port", "70000"),
    ("[broker]\nmetrics_port = -1", "broker.metrics_port", "-1"),
    ('[broker]\nmetrics_port = "9400"', "broker.metrics_port", '"9400"'),
    ("[broker]\nmetrics_port = true", "broker.metrics_port", "true"),
    ('[broker]\nmetrics_address = "localhost"', "broker.metrics_address", '"localhost"'),
    ('[broker]\nmetrics_address = "256.0.0.1"', "broker.metrics_address", '"256.0.0.1"'),
    ("[broker]\nmetrics_address = 1", "broker.metrics_address", "1"),
    ('[broker]\nmetrics_token_file = "token"', "broker.metrics_token_file", '"token"'),
    ("[broker]\njournal_keep_hours = 0", "broker.journal_keep_hours", "0"),
    ("[broker]\njournal_keep_hours = 0.05", "broker.journal_keep_hours", "0.05"),
    ("[broker]\njournal_keep_hours = nan", "broker.journal_keep_hours", "nan"),
    ("[broker]\njournal_keep_hours = 87601", "broker.journal_keep_hours", "87601"),
    (f'[broker]\nsocket_group = "{NO_SUCH_GROUP}"', "broker.socket_group", f'"{NO_SUCH_GROUP}"'),
    ('[broker]\nsocket_group = ""', "broker.socket_group", '""'),
    ("[broker]\nadmin_groups = [1, 2]", "broker.admin_groups", "[1, 2]"),
    ('[broker]\nadmin_groups = "gpuadmin"', "broker.admin_groups", '"gpuadmin"'),
    ('[broker]\nadmin_users = ["alice", ""]', "broker.admin_users", '["alice", ""]'),
    ('[broker]\nsharing = "fair"', "broker.sharing", '"fair"'),
    ("[broker]\nevict_when_memory_needed = 1", "broker.evict_when_memory_needed", "1"),
    ('[broker]\nmps = "yes"', "broker.mps", '"yes"'),
    ('[broker]\nnode_name = ""', "broker.node_name", '""'),
    ('[broker]\nnode_name = "   "', "broker.node_name", '"   "'),
    (f'[broker]\nnode_name = "{"n" * 65}"', "broker.node_name", '"' + "n" * 56 + "..."),
    ('[broker]\nnode_name = "gpu\\nnode"', "broker.node_name", '"gpu\\nnode"'),
    ("[broker]\ndevices = []", "broker.devices", "[]"),
    ("[broker]\ndevices = [0, 0]", "broker.devices", "[0, 0]"),
    ("[broker]\ndevices = [-1]", "broker.devices", "[-1]"),
    ("[broker]\ndevices = [true]", "broker.devices", "[true]"),
    ("[broker]\ndevices = [1.0]", "broker.devices", "[1.0]"),
    ("[broker]\ndevices = 0", "broker.devices", "0"),
    ('[broker]\nsocket = "broker.sock"', "broker.socket", '"broker.sock"'),
    (f'[broker]\nsocket = "/{"s" * 107}"', "broker.socket", '"/' + "s" * 55 + "..."),
    ('[broker]\njournal = "journal.sqlite"', "broker.journal", '"journal.sqlite"'),
    ('[broker]\ninventory = ""', "broker.inventory", '""'),
    ("[broker]\ninventory = 3", "broker.inventory", "3"),
    ("[broker]\nmetric_port = 9400", "broker.metric_port", "9400"),
    ("[defaults]\nmax_priority = true", "defaults.max_priority", "true"),
    ("[defaults]\nmax_priority = 2.5", "defaults.max_priority", "2.5"),
    ("[defaults]\nmax_priority = 300", "defaults.max_priority", "300"),
    ("[defaults]\nmax_priority = -1", "defaults.max_priority", "-1"),
    ('[defaults]\nmax_priority = "urgent"', "defaults.max_priority", '"urgent"'),
    ("[defaults]\nmemory_quota = 0", "defaults.memory_quota", "0"),
    ("[defaults]\nmemory_quota = 1.5", "defaults.memory_quota", "1.5"),
    ('[defaults]\nmemory_quota = "512KiB"', "defaults.memory_quota", '"512KiB"'),
    ('[defaults]\nmemory_quota = "2PiB"', "defaults.memory_quota", '"2PiB"'),
    ('[defaults]\nmemory_quota = "lots"', "defaults.memory_quota", '"lots"'),
    ("[defaults]\ndefault_memory = true", "defaults.default_memory", "true"),
    ("[defaults]\ndefault_memory = 1048575", "defaults.default_memory", "1048575"),
    ("[defaults]\nmax_leases = 0", "defaults.max_leases", "0"),
    ("[defaults]\nmax_leases = 10001", "defaults.max_leases", "10001"),
    ("[defaults]\nmax_leases = true", "defaults.max_leases", "true"),
    ("[defaults]\naging_per_minute = nan", "defaults.aging_per_minute", "nan"),
    ("[defaults]\naging_per_minute = inf", "defaults.aging_per_minute", "inf"),
    ("[defaults]\naging_per_minute = -1", "defaults.aging_per_minute", "-1"),
    ("[defaults]\naging_per_minute = 1001", "defaults.aging_per_minute", "1001"),
    ('[defaults]\nslice = "half"', "defaults.slice", '"half"'),
    ("[groups.students]\nmax_priority = true", "groups.students.max_priority", "true"),
    ("[groups.students]\nmax_prio = 3", "groups.students.max_prio", "3"),
    ("[users.alice]\nmemory_quota = 1.5", "users.alice.memory_quota", "1.5"),
    ("defaults = 5", "defaults", "5"),
    ("groups = 3", "groups", "3"),
    ('broker = "x"', "broker", '"x"'),
    ("groups.students = 4", "groups.students", "4"),
    ("users = []", "users", "[]"),
    ('users.bob = "x"', "users.bob", '"x"'),
    ("[defualts]\nmax_leases = 2", "defualts", "{max_leases = 2}"),
]


@pytest.mark.parametrize(("text", "key", "value"), WRONG, ids=[case[0] for case in WRONG])
def test_a_wrong_value_is_refused_with_one_line_naming_the_key_and_the_value(text, key, value):
    if NO_SUCH_GROUP in text:
        with pytest.raises(KeyError):  # the test means a group the host does not have
            grp.getgrnam(NO_SUCH_GROUP)
    error = refusal_of(text)
    assert str(error).startswith(f"broker.toml: {key} = {value}: "), str(error)
    assert error.key == key
    allowed = str(error).removeprefix(f"broker.toml: {key} = {value}: ")
    assert allowed.startswith(("must be ", "unknown setting; known: ", "unknown section; known: "))


def test_the_refusal_says_what_is_allowed_including_the_bounds():
    error = refusal_of("[broker]\nmax_requests_per_second = nan")
    assert str(error) == (
        "broker.toml: broker.max_requests_per_second = nan: "
        "must be a number > 0 and <= 1000000 (requests per second per user)"
    )
    quota = refusal_of("[defaults]\nmemory_quota = 1.5")
    assert "from 1 MiB to 1 PiB" in str(quota)
    unknown = refusal_of("[broker]\nmetric_port = 9400")
    assert "metrics_port" in str(unknown)  # the known keys are listed


def test_a_long_value_is_cut_so_the_line_stays_readable():
    names = ", ".join(f'"user{i:03}"' for i in range(200))
    error = refusal_of(f"[broker]\nadmin_users = [{names}, 7]")
    shown = str(error).split(" = ", 1)[1].split(": must be", 1)[0]
    assert len(shown) <= 60 and shown.endswith("...")


def test_a_policy_read_alone_is_refused_the_same_way():
    with pytest.raises(PolicyError) as raised:
        parse_policy("[broker]\nmax_requests_per_second = nan\n", "broker.toml")
    assert str(raised.value) == str(refusal_of("[broker]\nmax_requests_per_second = nan"))


def test_a_policy_built_in_code_has_its_sections_checked_on_use():
    policy = Policy(groups={"students": {"max_priority": "normal", "memory_quota": "16GiB"}})
    limits = policy.limits_for("bob", ("students",))
    assert (limits.max_priority, limits.memory_quota) == (150, 16 * GIB)
    broken = Policy(users={"bob": {"max_leases": 0}})
    with pytest.raises(PolicyError) as raised:
        broken.limits_for("bob", ())
    assert "users.bob.max_leases = 0" in str(raised.value)


# ------------------------------------------------------------------ files that are no TOML


@pytest.mark.parametrize(
    "data",
    [b"\xff\xfe[\x00b\x00r\x00", b'[broker]\nnode_name = "caf\xe9"\n', b"[broker]\x00\x00\n"],
    ids=["utf-16", "latin-1", "nul-bytes"],
)
def test_binary_garbage_is_not_a_text_file(data):
    error = refusal_of(data)
    assert str(error).startswith("broker.toml is not a text file")


def test_a_nul_in_text_is_refused_as_well():
    assert str(refusal_of("[broker]\0\n")).startswith("broker.toml is not a text file")


@pytest.mark.parametrize("text", ["[defaults\n", "[broker]\nsharing = \n", 'x = """\n\n'])
def test_a_toml_syntax_error_is_one_line(text):
    assert str(refusal_of(text)).startswith("broker.toml is not valid TOML: ")


def test_an_unreadable_file_names_the_path_and_the_reason(tmp_path):
    with pytest.raises(PolicyError) as missing:
        load_config(tmp_path / "nope.toml")
    assert str(missing.value) == f"config {tmp_path / 'nope.toml'} does not exist"
    with pytest.raises(PolicyError) as directory:
        load_config(tmp_path)
    assert str(directory.value) == (
        f"config {tmp_path} refused: it is a directory; only a regular file is read"
    )


def test_a_binary_file_on_disk_is_named(tmp_path):
    path = tmp_path / "broker.toml"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00")
    with pytest.raises(PolicyError) as raised:
        load_config(path)
    assert str(raised.value).startswith(f"{path} is not a text file")


# ------------------------------------------------------------------ right values


def test_the_example_file_is_read_as_written_from_text_bytes_or_disk():
    from_text = parse_config(EXAMPLE.read_text(), "deploy/broker.toml")
    assert parse_config(EXAMPLE.read_bytes(), "deploy/broker.toml") == from_text
    assert load_config(EXAMPLE) == from_text
    assert (from_text.reclaim_grace_s, from_text.lock_timeout_ms) == (60, 5000)
    assert (from_text.max_connections_per_uid, from_text.max_requests_per_second) == (32, 200)
    assert from_text.metrics_port == 9400 and from_text.metrics_address == "127.0.0.1"
    assert from_text.policy.evict_when_memory_needed is True
    assert from_text.policy.users["ta-anna"] == {"max_priority": 250}


def test_every_broker_key_with_a_right_value_lands_in_the_config():
    group = existing_group()
    text = f"""
[broker]
socket = "/run/gpushare/broker.sock"
journal = "/var/lib/gpushare/journal.sqlite"
inventory = "h200-x2"
metrics_port = 9400
metrics_address = "::1"
metrics_token_file = "/etc/gpushare/metrics.token"
max_connections_per_uid = 100000
max_requests_per_second = 0.5
reclaim_grace_s = 0
lock_timeout_ms = 600000
grant_after_stops_ms = 0
journal_keep_hours = 0.1
socket_group = "{group}"
node_name = "gpu-node-7"
devices = [1, 0]
admin_groups = ["gpuadmin"]
admin_users = ["hubadmin"]
sharing = "exclusive"
evict_when_memory_needed = false
park_when_memory_needed = false
park_host_limit = "80%"
mps = true
"""
    config = parse_config(text, "broker.toml")
    assert config == BrokerConfig(
        socket="/run/gpushare/broker.sock", journal="/var/lib/gpushare/journal.sqlite",
        inventory="h200-x2", metrics_port=9400, metrics_address="::1",
        metrics_token_file="/etc/gpushare/metrics.token", max_connections_per_uid=100000,
        max_requests_per_second=0.5, reclaim_grace_s=0.0, lock_timeout_ms=600000,
        grant_after_stops_ms=0, journal_keep_hours=0.1, socket_group=group, node_name="gpu-node-7", devices=[1, 0],
        policy=Policy(
            sharing="exclusive", admin_groups=("gpuadmin",), admin_users=("hubadmin",),
            evict_when_memory_needed=False, park_when_memory_needed=False,
            park_host_limit=HostShare(percent=80.0), mps=True,
        ),
        given=frozenset(schema.BROKER_SETTINGS),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("line", "field", "expected"),
    [
        ("max_priority = 0", "max_priority", 0),
        ("max_priority = 299", "max_priority", 299),
        ('max_priority = "low"', "max_priority", 50),
        ('max_priority = "high"', "max_priority", 250),
        ("memory_quota = 1048576", "memory_quota", MIB),
        ('memory_quota = "1PiB"', "memory_quota", 1024**5),
        ('memory_quota = "2GB"', "memory_quota", 2 * 1000**3),
        ('default_memory = "512MiB"', "default_memory", 512 * MIB),
        ("max_leases = 1", "max_leases", 1),
        ("max_leases = 10000", "max_leases", 10000),
        ("aging_per_minute = 0", "aging_per_minute", 0.0),
        ("aging_per_minute = 1000.0", "aging_per_minute", 1000.0),
        ('slice = "exclusive"', "slice", SliceWish.EXCLUSIVE),
    ],
)
def test_limits_at_their_bounds_are_accepted(line, field, expected):
    limits = parse_config(f"[defaults]\n{line}\n").policy.defaults
    assert getattr(limits, field) == expected
    assert type(getattr(limits, field)) is type(expected)


def test_the_built_in_defaults_are_the_schemas():
    config, limits, policy = BrokerConfig(), Limits(), Policy()
    for key, setting in schema.BROKER_SETTINGS.items():
        where = policy if key in schema.POLICY_BROKER_KEYS else config
        assert getattr(where, key) == setting.default, key
    for key, setting in schema.LIMIT_SETTINGS.items():
        assert getattr(limits, key) == setting.default, key
    assert limits.max_priority == 250  # "high", as docs/policy.md says
    assert parse_config("") == BrokerConfig()


def test_every_config_field_is_a_schema_key():
    own = {f.name for f in fields(BrokerConfig)} - {"policy", "given"}
    assert own == set(schema.BROKER_SETTINGS) - set(schema.POLICY_BROKER_KEYS)
    assert {f.name for f in fields(Limits)} == set(schema.LIMIT_SETTINGS)


# ------------------------------------------------------------------ given and restart


def test_given_holds_the_broker_keys_the_file_names():
    assert parse_config("").given == frozenset()
    assert parse_config('[broker]\nsharing = "timeslice"\n').given == {"sharing"}
    example = parse_config(EXAMPLE.read_text())
    assert example.given == {
        "admin_groups", "admin_users", "sharing", "evict_when_memory_needed", "reclaim_grace_s",
        "lock_timeout_ms", "grant_after_stops_ms", "max_connections_per_uid",
        "max_requests_per_second", "metrics_port",
    }  # fmt: skip


# A right value, other than the default and the example's, for each [broker] key.
OTHER_VALUES = {
    "socket": '"/run/gpushare/other.sock"',
    "journal": '"/srv/gpushare/journal.sqlite"',
    "inventory": '"h200-x2"',
    "metrics_port": "9500",
    "metrics_address": '"0.0.0.0"',
    "metrics_token_file": '"/etc/gpushare/metrics.token"',
    "socket_group": None,  # an existing group, found when the test runs
    "node_name": '"gpu-node-7"',
    "devices": "[1]",
    "admin_groups": '["staff"]',
    "admin_users": '["hubadmin"]',
    "sharing": '"exclusive"',
    "evict_when_memory_needed": "false",
    "park_when_memory_needed": "false",
    "park_host_limit": '"64GiB"',
    "mps": "true",
    "max_connections_per_uid": "8",
    "max_requests_per_second": "50",
    "reclaim_grace_s": "5",
    "lock_timeout_ms": "100",
    "grant_after_stops_ms": "250",
    "journal_keep_hours": "720",
}


def test_the_restart_keys_are_the_daemons_own():
    assert set(schema.restart_keys()) == {
        "socket", "journal", "inventory", "metrics_port", "metrics_address",
        "metrics_token_file", "socket_group", "node_name", "devices",
    }  # fmt: skip
    assert set(OTHER_VALUES) == set(schema.BROKER_SETTINGS)


def value_of(config: BrokerConfig, key: str) -> object:
    return getattr(config.policy if key in schema.POLICY_BROKER_KEYS else config, key)


def with_broker_line(key: str, value: str) -> str:
    # Replace the example's own line for the key, if it has one: TOML refuses a key twice.
    example = re.sub(rf"^{key} = .*\n", "", EXAMPLE.read_text(), flags=re.MULTILINE)
    return example.replace("[broker]\n", f"[broker]\n{key} = {value}\n", 1)


@pytest.mark.parametrize("key", sorted(OTHER_VALUES))
def test_a_changed_key_needs_a_restart_exactly_when_the_schema_says(key):
    running = parse_config(EXAMPLE.read_text())
    new = parse_config(with_broker_line(key, OTHER_VALUES[key] or f'"{existing_group()}"'))
    assert value_of(new, key) != value_of(running, key)  # the file really changed it
    expected = [key] if schema.BROKER_SETTINGS[key].applies == "restart" else []
    assert restart_needed(running, new) == expected


def test_a_reload_of_the_same_file_needs_no_restart():
    running = parse_config(EXAMPLE.read_text())
    assert restart_needed(running, parse_config(EXAMPLE.read_bytes())) == []


def test_only_keys_the_new_file_names_are_compared():
    # --journal and --metrics-port put values into the running config that the file
    # does not name; reloading that file must not report them.
    running = replace(parse_config(EXAMPLE.read_text()), journal="/tmp/j.sqlite")
    assert restart_needed(running, parse_config(EXAMPLE.read_text())) == []
    named = parse_config('[broker]\njournal = "/var/lib/gpushare/journal.sqlite"\nmetrics_port = 1')
    assert restart_needed(running, named) == ["journal", "metrics_port"]


# ------------------------------------------------------------------ the docs agree


def _broker_table_rows() -> dict[str, str]:
    text = (REPO / "docs" / "policy.md").read_text()
    section = text.split("## `[broker]`", 1)[1].split("\n## ", 1)[0]
    applies: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for key in re.findall(r"`(\w+)`", cells[0]):
            applies[key] = cells[-1]
    return applies


def test_the_docs_list_every_broker_key_and_when_it_applies():
    rows = _broker_table_rows()
    assert set(rows) == set(schema.BROKER_SETTINGS)
    for key, setting in schema.BROKER_SETTINGS.items():
        assert rows[key] == setting.applies, key


def test_the_docs_list_every_limit_key():
    text = (REPO / "docs" / "policy.md").read_text()
    for key in schema.LIMIT_SETTINGS:
        assert f"| `{key}` |" in text, key
