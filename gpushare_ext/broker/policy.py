"""Who may ask for what, and how the broker stops someone: the policy half of scheduling.

Pure data and pure functions (no I/O beyond parsing a TOML string): per-user and
per-group limits (max priority, memory quota, default memory, max concurrent leases,
slice wish, aging rate), the device sharing mode, and the two decisions the scheduler
core delegates here: which preemption level stops a victim, and in which order victims
are chosen.

The policy file (``/etc/gpushare/broker.toml`` in system mode) looks like::

    [broker]
    admin_groups = ["gpuadmin"]
    sharing = "timeslice"          # or "exclusive": one running lease per GPU/MIG slot

    [defaults]
    max_priority = "high"
    memory_quota = "40GiB"         # the most one lease may hold
    default_memory = "8GiB"        # what a lease gets when it names no memory
    max_leases = 4                 # leases one user may hold or wait for at once
    aging_per_minute = 10          # priority points a waiting request gains per minute
    slice = "auto"                 # auto | mig | shared | exclusive

    [groups.students]
    max_priority = "normal"
    memory_quota = "16GiB"

    [users.alice]
    max_priority = "high"

Users inherit ``defaults``, then each of their groups in file order, then their own
section; later sections override earlier ones field by field.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, fields, replace

from gpushare_ext.protocol import PRIORITY_CLASSES, PreemptionLevel, SliceWish, priority_value

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 1024**3
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1000,
    "KIB": 1024,
    "KI": 1024,
    "M": 1024**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "MI": 1024**2,
    "G": 1024**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "GI": 1024**3,
    "T": 1024**4,
    "TB": 1000**4,
    "TIB": 1024**4,
    "TI": 1024**4,
}


class PolicyError(Exception):
    """A policy file or value that cannot be used; the message names the key and the problem."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` ("8GiB", "512MB", "1.5G", 1024); ValueError with a readable reason."""
    if isinstance(text, bool):
        raise ValueError("a size must be a number of bytes or text like 8GiB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 8GiB, 512MiB, 2GB)")
    number, unit = match.groups()
    multiplier = _UNITS.get((unit or "").upper())
    if multiplier is None:
        raise ValueError(f"{text!r} has an unknown unit {unit!r}")
    return int(float(number) * multiplier)


def format_size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num_bytes} B"  # pragma: no cover


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The limits that apply to one user after defaults, groups and user sections merge."""

    max_priority: int = PRIORITY_CLASSES["high"] + 49
    memory_quota: int = 1 << 50  # effectively "the device"
    default_memory: int = 8 * GIB
    max_leases: int = 8
    aging_per_minute: float = 10.0
    slice: SliceWish = SliceWish.AUTO


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The whole policy: sharing mode, admins, and limits by user and group name."""

    sharing: str = "timeslice"
    admin_groups: tuple[str, ...] = ()
    admin_users: tuple[str, ...] = ()
    defaults: Limits = field(default_factory=Limits)
    groups: dict[str, dict] = field(default_factory=dict)
    users: dict[str, dict] = field(default_factory=dict)
    evict_when_memory_needed: bool = True
    mps: bool = False  # an MPS daemon serves the GPUs: shares become MPS limits

    def limits_for(self, user: str, groups: tuple[str, ...]) -> Limits:
        limits = self.defaults
        for group, section in self.groups.items():  # file order, as documented
            if group in groups:
                limits = _apply(limits, section, f"groups.{group}")
        if user in self.users:
            limits = _apply(limits, self.users[user], f"users.{user}")
        return limits

    def is_admin(self, uid: int, user: str, groups: tuple[str, ...]) -> bool:
        return uid == 0 or user in self.admin_users or any(g in self.admin_groups for g in groups)


_LIMIT_FIELDS = {f.name for f in fields(Limits)}


def _coerce_limit(name: str, value: object, where: str) -> object:
    try:
        if name == "max_priority":
            return priority_value(value)  # type: ignore[arg-type]
        if name in ("memory_quota", "default_memory"):
            return parse_size(value)  # type: ignore[arg-type]
        if name == "max_leases":
            if not isinstance(value, int) or value < 1:
                raise ValueError("must be a whole number >= 1")
            return value
        if name == "aging_per_minute":
            if not isinstance(value, int | float) or value < 0:
                raise ValueError("must be a number >= 0")
            return float(value)
        if name == "slice":
            return SliceWish(str(value))
    except ValueError as exc:
        raise PolicyError(f"{where}.{name}: {exc}") from None
    raise PolicyError(f"{where}.{name}: unknown setting")  # pragma: no cover


def _apply(limits: Limits, section: dict, where: str) -> Limits:
    changes = {}
    for key, value in section.items():
        if key not in _LIMIT_FIELDS:
            raise PolicyError(
                f"{where}: unknown setting {key!r}; known: {', '.join(sorted(_LIMIT_FIELDS))}"
            )
        changes[key] = _coerce_limit(key, value, where)
    return replace(limits, **changes)


def parse_policy(text: str) -> Policy:
    """Policy from TOML text; PolicyError names the offending key."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy is not valid TOML: {exc}") from None
    return policy_from_document(document)


def policy_from_document(document: dict) -> Policy:
    known_top = {"broker", "defaults", "groups", "users"}
    unknown = set(document) - known_top
    if unknown:
        raise PolicyError(f"unknown section(s) {sorted(unknown)}; known: {sorted(known_top)}")
    broker = document.get("broker", {})
    sharing = broker.get("sharing", "timeslice")
    if sharing not in ("timeslice", "exclusive"):
        raise PolicyError(f"broker.sharing must be 'timeslice' or 'exclusive', not {sharing!r}")
    defaults = _apply(Limits(), document.get("defaults", {}), "defaults")
    groups = document.get("groups", {})
    users = document.get("users", {})
    for where, table in (("groups", groups), ("users", users)):
        if not isinstance(table, dict):
            raise PolicyError(f"{where} must be a table of tables")
        for name, section in table.items():
            _apply(defaults, section, f"{where}.{name}")  # validate now, apply per user later
    return Policy(
        sharing=sharing,
        admin_groups=tuple(broker.get("admin_groups", ())),
        admin_users=tuple(broker.get("admin_users", ())),
        defaults=defaults,
        groups=dict(groups),
        users=dict(users),
        evict_when_memory_needed=bool(broker.get("evict_when_memory_needed", True)),
        mps=bool(broker.get("mps", False)),
    )


# ------------------------------------------------------------------ decisions


def priority_band(value: float) -> int:
    """The class of a priority number: 0 low, 1 normal, 2 high.  Preemption crosses bands only."""
    return int(min(max(value, 0), 299) // 100)


def effective_priority(base: int, waited_s: float, aging_per_minute: float) -> float:
    """Base priority plus what waiting earned, capped at the top of the high band."""
    return min(299.0, base + aging_per_minute * waited_s / 60.0)


@dataclass(frozen=True, kw_only=True)
class VictimTraits:
    """What the core knows about a running lease when it must be stopped."""

    gate: bool
    yield_flag: bool
    instrumented_only: bool
    lockable: bool
    evictable: bool


def stopping_level(traits: VictimTraits) -> PreemptionLevel | None:
    """The cheapest ladder level that stops all of a victim's GPU work, or None if none can.

    The yield flag stops instrumented kernels in flight, so a session whose GPU work is
    all instrumented yields (level 1).  Anything else is locked (level 3): the gate
    alone holds only launches not yet issued, so it is the answer only for a process
    that cannot be locked (an MPS client), and then it is best effort.
    """
    if traits.instrumented_only and traits.yield_flag:
        return PreemptionLevel.YIELD
    if traits.lockable:
        return PreemptionLevel.LOCK
    if traits.gate:
        return PreemptionLevel.GATE  # best effort: holds new launches, not those in flight
    return None


def victim_order_key(priority: float, memory_bytes: int, started_seq: int) -> tuple:
    """Victims are taken lowest priority first, then the most memory, then the newest."""
    return (priority, -memory_bytes, -started_seq)
