"""Every setting of the broker's TOML file in one table: what it accepts, its default,
the words an admin reads when a value is wrong, and whether a running broker can take
a change without a restart.

``config.py`` (the ``[broker]`` table) and ``policy.py`` (the policy half of that table
and the ``[defaults]``, ``[groups.NAME]``, ``[users.NAME]`` limits) both read values
through here, so a key is checked the same way whichever of them reads it.  Each wrong
value raises :class:`PolicyError` with one line::

    broker.toml: broker.max_requests_per_second = nan: must be a number > 0 and ...

Keys are data from the file: every message shows them through :func:`key_text` (an
escape or a newline in a key never reaches a terminal raw), and the names of
``[users.NAME]``, ``[groups.NAME]`` and the admin lists must be account names.

This module must not import ``config.py``, ``policy.py`` or ``server.py`` (they import
it), read files or sockets, or know what the broker does with a value.  The one look-up
outside the text is ``socket_group``: a group that does not exist is refused here rather
than when the socket is created.
"""

from __future__ import annotations

import datetime
import grp
import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.plain_text import plain_text
from gpushare_ext.protocol import SliceWish, priority_value
from gpushare_ext.units import GIB, KIB, MIB, PIB, parse_duration, parse_size


class PolicyError(DaemonError):
    """A config or policy value that cannot be used; the message is one line naming the
    file, the dotted key, the value and what is allowed.  ``key`` is that dotted key,
    where there is one (not for a file that is not TOML at all)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ------------------------------------------------------------------ kinds of value
#
# A kind says in words what it accepts (``text``) and turns an accepted TOML value into
# what the broker uses (``convert``), raising ValueError otherwise.  The reason inside
# that ValueError is not shown: the error always repeats what *is* allowed, so an admin
# reads one sentence per key whatever was wrong with the value.


class Kind(Protocol):
    @property
    def text(self) -> str: ...

    def convert(self, value: object) -> object: ...


def _number_text(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


def _is_whole(value: object) -> bool:
    # TOML booleans are Python bools, and bool is an int: true must never pass as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _size_text(num_bytes: int) -> str:
    for unit, factor in (("PiB", PIB), ("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes % factor == 0:
            return f"{num_bytes // factor} {unit}"
    return f"{num_bytes} bytes"


@dataclass(frozen=True)
class Whole:
    low: int
    high: int

    @property
    def text(self) -> str:
        return f"a whole number from {self.low} to {self.high}"

    def convert(self, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(value)
        if not self.low <= value <= self.high:
            raise ValueError(value)
        return value


@dataclass(frozen=True)
class Number:
    """A finite int or float; ``low`` is excluded when ``above`` (e.g. "> 0")."""

    low: float
    high: float
    above: bool = False

    @property
    def text(self) -> str:
        if self.above:
            return f"a number > {_number_text(self.low)} and <= {_number_text(self.high)}"
        return f"a number from {_number_text(self.low)} to {_number_text(self.high)}"

    def convert(self, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(value)
        number = float(value)
        if not math.isfinite(number) or number > self.high:
            raise ValueError(value)
        if number < self.low or (self.above and number == self.low):
            raise ValueError(value)
        return number


@dataclass(frozen=True)
class Flag:
    @property
    def text(self) -> str:
        return "true or false"

    def convert(self, value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(value)
        return value


@dataclass(frozen=True)
class OneOf:
    choices: tuple[str, ...]
    make: Callable[[str], object] = str

    @property
    def text(self) -> str:
        quoted = [json.dumps(choice) for choice in self.choices]
        return f"{', '.join(quoted[:-1])} or {quoted[-1]}"

    def convert(self, value: object) -> object:
        if not isinstance(value, str) or value not in self.choices:
            raise ValueError(value)
        return self.make(value)


@dataclass(frozen=True)
class Text:
    max_chars: int

    @property
    def text(self) -> str:
        return f"a non-empty string of at most {self.max_chars} characters, on one line"

    def convert(self, value: object) -> str:
        if not isinstance(value, str) or not value.strip() or len(value) > self.max_chars:
            raise ValueError(value)
        if not value.isprintable():  # a newline in a node name would break status tables
            raise ValueError(value)
        return value


@dataclass(frozen=True)
class AbsolutePath:
    max_bytes: int

    @property
    def text(self) -> str:
        return f"an absolute path of at most {self.max_bytes} bytes"

    def convert(self, value: object) -> str:
        if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
            raise ValueError(value)
        if len(os.fsencode(value)) > self.max_bytes:
            raise ValueError(value)
        return value


@dataclass(frozen=True)
class GroupName:
    @property
    def text(self) -> str:
        return "the name of a group that exists on this host"

    def convert(self, value: object) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(value)
        try:
            grp.getgrnam(value)
        except (KeyError, ValueError):  # ValueError: a NUL inside the name
            raise ValueError(value) from None
        return value


@dataclass(frozen=True)
class IPAddress:
    @property
    def text(self) -> str:
        return "an IPv4 or IPv6 address, e.g. 127.0.0.1 or ::1"

    def convert(self, value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(value)
        ipaddress.ip_address(value)  # its ValueError is the refusal
        return value


# An account name as Unix user databases give them: POSIX's portable set, plus "@" and
# "\\" for directory-service names (alice@example.org, DOMAIN\\alice) and a final "$"
# (Samba machine accounts).  Anything else (a space, a control character, a "/") names
# no account, so a policy that holds one is refused rather than shown to anybody.
_ACCOUNT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@\\-]*\$?")
ACCOUNT_NAME_LIMIT = 256
ACCOUNT_NAME_TEXT = (
    f"a user or group name: letters, digits, '_', '.', '@', '\\', '-' (not first), an "
    f"optional final '$', at most {ACCOUNT_NAME_LIMIT} characters"
)


def is_account_name(name: object) -> bool:
    """Whether ``name`` can be a Unix user or group name (see ``_ACCOUNT_NAME``)."""
    return (
        isinstance(name, str)
        and len(name) <= ACCOUNT_NAME_LIMIT
        and _ACCOUNT_NAME.fullmatch(name) is not None
    )


@dataclass(frozen=True)
class Names:
    @property
    def text(self) -> str:
        return f'a list of user or group names, e.g. ["gpuadmin"] ({ACCOUNT_NAME_TEXT})'

    def convert(self, value: object) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(is_account_name(n) for n in value):
            raise ValueError(value)
        return tuple(value)


@dataclass(frozen=True)
class Indices:
    high: int

    @property
    def text(self) -> str:
        return f"a non-empty list of distinct GPU indices from 0 to {self.high}, e.g. [0, 1]"

    def convert(self, value: object) -> list[int]:
        if not isinstance(value, list) or not value or len(set(value)) != len(value):
            raise ValueError(value)
        if not all(_is_whole(i) and 0 <= i <= self.high for i in value):
            raise ValueError(value)
        return list(value)


@dataclass(frozen=True)
class Size:
    low: int
    high: int

    @property
    def text(self) -> str:
        return (
            'a size like "16GiB", "512MiB" or "2GB", or a whole number of bytes, '
            f"from {_size_text(self.low)} to {_size_text(self.high)}"
        )

    def convert(self, value: object) -> int:
        # A bare float is refused: 1.5 reads as "1.5 GiB" to a person and 1 byte to us.
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(value)
        size = parse_size(value)
        if not self.low <= size <= self.high:
            raise ValueError(value)
        return size


@dataclass(frozen=True)
class Duration:
    """A duration in TOML text ("15m", "2h", "90s") up to ``high_s``, or "off": None."""

    high_s: float

    @property
    def text(self) -> str:
        return (
            f'a duration like "15m", "2h" or "90s" (or seconds) up to {self.high_s / 3600:g} h, '
            'or "off"'
        )

    def convert(self, value: object) -> float | None:
        # None and a number of seconds are what a converted section holds already.
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError(value)
        seconds = parse_duration(str(value))  # ValueError for what is not a duration
        if seconds is not None and not 1.0 <= seconds <= self.high_s:
            raise ValueError(value)
        return seconds


@dataclass(frozen=True)
class HostShare:
    """How much host memory something may use: a share of the host ("50%") or a size."""

    percent: float | None = None
    size: int | None = None

    def of(self, total_bytes: int) -> int:
        if self.size is not None:
            return self.size
        return int(total_bytes * (self.percent or 0.0) / 100.0)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.size is None else _size_text(self.size)


@dataclass(frozen=True)
class HostShareKind:
    @property
    def text(self) -> str:
        return 'a share of the host\'s memory like "50%" (0-95 %) or a size like "64GiB"'

    def convert(self, value: object) -> HostShare:
        if isinstance(value, HostShare):
            return value
        if isinstance(value, str) and value.strip().endswith("%"):
            percent = float(value.strip()[:-1])  # ValueError for what is not a number
            if not (math.isfinite(percent) and 0.0 <= percent <= 95.0):
                raise ValueError(value)
            return HostShare(percent=percent)
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(value)
        return HostShare(size=parse_size(value))


@dataclass(frozen=True)
class Priority:
    @property
    def text(self) -> str:
        return '"low", "normal", "high" or a whole number from 0 to 299'

    def convert(self, value: object) -> int:
        # priority_value reads "2.5" as text and refuses it, but 2.5 as a float would be
        # str()-ed first; only text and whole numbers reach it.
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError(value)
        return priority_value(value)


# ------------------------------------------------------------------ the table

Applies = Literal["live", "restart"]


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One key: what it accepts, its default, and whether a reload applies it."""

    key: str
    kind: Kind
    default: object
    meaning: str  # a few words, shown after the allowed values
    applies: Applies

    @property
    def allowed(self) -> str:
        return f"must be {self.kind.text} ({self.meaning})"


BROKER_SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting(
            key="socket",
            kind=AbsolutePath(107),  # sun_path holds 108 bytes with the final NUL
            default=None,
            meaning="the broker's Unix socket",
            applies="restart",
        ),
        Setting(
            key="journal",
            kind=AbsolutePath(4095),
            default=None,
            meaning="the journal's SQLite file",
            applies="restart",
        ),
        Setting(
            key="inventory",
            kind=Text(4096),
            default="auto",
            meaning="auto, nvml or a fixture",
            applies="restart",
        ),
        Setting(
            key="metrics_port",
            kind=Whole(1, 65535),
            default=None,
            meaning="the TCP port of the Prometheus metrics",
            applies="restart",
        ),
        Setting(
            key="metrics_address",
            kind=IPAddress(),
            default="127.0.0.1",
            meaning="where the metrics port listens",
            applies="restart",
        ),
        Setting(
            key="metrics_token_file",
            kind=AbsolutePath(4095),
            default=None,
            meaning="a file holding the bearer token scrapers must send",
            applies="restart",
        ),
        Setting(
            key="socket_group",
            kind=GroupName(),
            default=None,
            meaning="the group the socket is opened to",
            applies="restart",
        ),
        Setting(
            key="node_name",
            kind=Text(64),
            default=None,
            meaning="the name status views show for this host",
            applies="restart",
        ),
        Setting(
            key="devices",
            kind=Indices(1023),
            default=None,
            meaning="the GPUs this broker manages",
            applies="restart",
        ),
        Setting(
            key="admin_groups",
            kind=Names(),
            default=(),
            meaning="Unix groups whose members are admins",
            applies="live",
        ),
        Setting(
            key="admin_users",
            kind=Names(),
            default=(),
            meaning="Unix users who are admins",
            applies="live",
        ),
        Setting(
            key="sharing",
            kind=OneOf(("timeslice", "exclusive")),
            default="timeslice",
            meaning="how leases of one priority band share a GPU",
            applies="live",
        ),
        Setting(
            key="evict_when_memory_needed",
            kind=Flag(),
            default=True,
            meaning="checkpoint a paused lease to host memory when its memory is needed",
            applies="live",
        ),
        Setting(
            key="park_when_memory_needed",
            kind=Flag(),
            default=True,
            meaning="checkpoint idle sessions to host memory when a request needs their memory",
            applies="live",
        ),
        Setting(
            key="park_host_limit",
            kind=HostShareKind(),
            default=HostShare(percent=50.0),
            meaning="the most host memory parked and evicted sessions may hold together",
            applies="live",
        ),
        Setting(
            key="mps",
            kind=Flag(),
            default=False,
            meaning="an MPS daemon serves the GPUs",
            applies="live",
        ),
        Setting(
            key="max_connections_per_uid",
            kind=Whole(1, 100_000),
            default=32,
            meaning="open connections per user",
            applies="live",
        ),
        Setting(
            key="max_requests_per_second",
            kind=Number(0, 1_000_000, above=True),
            default=200.0,
            meaning="requests per second per user",
            applies="live",
        ),
        Setting(
            key="reclaim_grace_s",
            kind=Number(0, 86_400),
            default=30.0,
            meaning="seconds sessions have to reclaim leases after a restart",
            applies="live",
        ),
        Setting(
            key="lock_timeout_ms",
            kind=Whole(1, 600_000),
            default=5000,
            meaning="milliseconds a checkpoint lock may wait for in-flight GPU work",
            applies="live",
        ),
        Setting(
            key="grant_after_stops_ms",
            kind=Whole(0, 60_000),
            default=30,
            meaning=(
                "milliseconds a grant may wait for the sessions it pauses to leave the GPU "
                "(0: grant at once)"
            ),
            applies="live",
        ),
        Setting(
            key="journal_keep_hours",
            kind=Number(0.1, 87_600),
            default=24.0,
            meaning="hours ended leases and history stay in the journal",
            applies="live",
        ),
    )
}

# The [broker] keys that make up the policy (Policy's fields) rather than the daemon's.
POLICY_BROKER_KEYS = (
    "admin_groups",
    "admin_users",
    "sharing",
    "evict_when_memory_needed",
    "park_when_memory_needed",
    "park_host_limit",
    "mps",
)

LIMIT_SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        Setting(
            key="max_priority",
            kind=Priority(),
            default=priority_value("high"),
            meaning="the highest priority a cell may ask for",
            applies="live",
        ),
        Setting(
            key="memory_quota",
            kind=Size(MIB, PIB),
            default=PIB,
            meaning="the most device memory one lease may hold",
            applies="live",
        ),
        Setting(
            key="default_memory",
            kind=Size(MIB, PIB),
            default=8 * GIB,
            meaning="the memory of a lease that names none",
            applies="live",
        ),
        Setting(
            key="max_leases",
            kind=Whole(1, 10_000),
            default=8,
            meaning="leases one user may hold or wait for at once (a gang of N ranks counts N)",
            applies="live",
        ),
        Setting(
            key="aging_per_minute",
            kind=Number(0, 1000),
            default=10.0,
            meaning="priority points a waiting request gains per minute",
            applies="live",
        ),
        Setting(
            key="slice",
            kind=OneOf(tuple(wish.value for wish in SliceWish), SliceWish),
            default=SliceWish.AUTO,
            meaning="the slice a lease gets unless the cell asks for one",
            applies="live",
        ),
        Setting(
            key="park_idle_after",
            kind=Duration(7 * 24 * 3600),
            default=None,
            meaning="park a session whose GPU memory sat idle this long",
            applies="live",
        ),
    )
}

SECTIONS = ("broker", "defaults", "groups", "users")


# ------------------------------------------------------------------ reading values

_SHOWN_CHARS = 60


def shown(value: object) -> str:
    """``value`` as the admin wrote it in TOML, on one line and at most ~60 characters."""
    text = _toml_repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _toml_repr(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # ensure_ascii: no character in the message can break the line (U+2028 and kin).
        return json.dumps(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_repr(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return " ".join(str(value).split())  # ints, and anything else on one line


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def key_text(key: str) -> str:
    """One key of a dotted path as TOML writes it, shown as plain text: a bare key as it
    is, any other quoted, with every character that would not show as itself (an escape,
    a newline) replaced by its stand-in.  A key comes from the file: it is data."""
    if _BARE_KEY.fullmatch(key):
        return key
    quoted = key.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + plain_text(quoted, limit=_SHOWN_CHARS) + '"'


def refusal(source: str, key: str, value: object, allowed: str) -> PolicyError:
    return PolicyError(f"{source}: {key} = {shown(value)}: {allowed}", key=key)


def check_value(setting: Setting, value: object, where: str, source: str) -> object:
    """``value`` of ``setting`` (found under ``where``) converted, or PolicyError."""
    key = f"{where}.{setting.key}"
    try:
        return setting.kind.convert(value)
    except ValueError:
        raise refusal(source, key, value, setting.allowed) from None


def read_table(
    table: Mapping[str, object], settings: Mapping[str, Setting], where: str, source: str
) -> dict[str, object]:
    """Every key of ``table`` checked against ``settings`` and converted; unknown keys refused."""
    values: dict[str, object] = {}
    for key, value in table.items():
        setting = settings.get(key)
        if setting is None:
            known = ", ".join(sorted(settings))
            raise refusal(
                source, f"{where}.{key_text(key)}", value, f"unknown setting; known: {known}"
            )
        values[key] = check_value(setting, value, where, source)
    return values


@dataclass(frozen=True, kw_only=True)
class Sections:
    """The four sections of a document, each checked to be a table (values not yet read)."""

    broker: dict[str, object]
    defaults: dict[str, object]
    groups: dict[str, dict[str, object]]
    users: dict[str, dict[str, object]]


def sections(document: Mapping[str, object], source: str) -> Sections:
    """The document's sections; PolicyError for an unknown section or one that is no table."""
    for name, value in document.items():
        if name not in SECTIONS:
            known = ", ".join(SECTIONS)
            raise refusal(source, key_text(name), value, f"unknown section; known: {known}")
    tables: dict[str, dict] = {}
    for name in SECTIONS:
        table = document.get(name, {})
        if not isinstance(table, dict):
            shape = f"of [{name}.NAME] tables" if name in ("groups", "users") else f"([{name}])"
            raise refusal(source, name, table, f"must be a table {shape}")
        tables[name] = table
    for name in ("groups", "users"):
        for who, section in tables[name].items():
            where = f"{name}.{key_text(who)}"
            if not is_account_name(who):
                raise refusal(source, where, section, f"NAME must be {ACCOUNT_NAME_TEXT}")
            if not isinstance(section, dict):
                raise refusal(source, where, section, f"must be a table ([{name}.NAME])")
    return Sections(
        broker=tables["broker"],
        defaults=tables["defaults"],
        groups=tables["groups"],
        users=tables["users"],
    )


def read_broker(table: Mapping[str, object], source: str) -> dict[str, object]:
    """The ``[broker]`` keys ``table`` names, checked and converted."""
    return read_table(table, BROKER_SETTINGS, "broker", source)


def read_limits(table: Mapping[str, object], where: str, source: str) -> dict[str, object]:
    """The limit keys of one ``[defaults]``/``[groups.NAME]``/``[users.NAME]`` table."""
    return read_table(table, LIMIT_SETTINGS, where, source)


def restart_keys() -> tuple[str, ...]:
    """The ``[broker]`` keys a running broker cannot apply: changing one needs a restart."""
    return tuple(key for key, s in BROKER_SETTINGS.items() if s.applies == "restart")
