"""Who may ask for what, and how the broker stops someone: the policy half of scheduling.

Pure data and pure functions (no I/O beyond parsing a TOML string): per-user and
per-group limits (max priority, memory quota, default memory, max concurrent leases,
slice wish, aging rate), the device sharing mode, and the two decisions the scheduler
core delegates here: which preemption level stops a victim (:func:`ladder_level`, the
one place that level is chosen), and in which order victims
are chosen.  Every value is checked and converted by :mod:`gpushare_ext.broker.settings.schema`
(what each key accepts lives there, not here).  This module must not import
``config.py`` or ``server.py``: they import it.

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
    park_idle_after = "off"        # e.g. "15m": park a session idle that long

    [groups.students]
    max_priority = "normal"
    memory_quota = "16GiB"

    [users.alice]
    max_priority = "high"

Users inherit ``defaults``, then each of their groups in file order, then their own
section; later sections override earlier ones field by field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from gpushare_ext.broker.settings import schema
from gpushare_ext.broker.settings.config_text import parse_document
from gpushare_ext.broker.settings.schema import HostShare, PolicyError
from gpushare_ext.protocol import PRIORITY_CLASSES, PreemptionLevel, SliceWish
from gpushare_ext.units import GIB, format_size, parse_size, priority_band

# PolicyError and the size helpers live in schema.py, which both this module and
# config.py read values through; they are re-exported here, where callers import them.
__all__ = [
    "GIB",
    "HostShare",
    "Limits",
    "Policy",
    "PolicyError",
    "StopCause",
    "VictimTraits",
    "effective_priority",
    "format_size",
    "ladder_level",
    "lock_kept_when_failing",
    "parse_policy",
    "parse_size",
    "policy_from_document",
    "priority_band",
    "stopping_level",
    "victim_order_key",
]


HALF_THE_HOST = HostShare(percent=50.0)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The limits that apply to one user after defaults, groups and user sections merge.

    The defaults here are those of ``schema.LIMIT_SETTINGS`` (a test keeps them equal).
    """

    max_priority: int = PRIORITY_CLASSES["high"]
    memory_quota: int = 1 << 50  # 1 PiB: effectively "the device"
    default_memory: int = 8 * GIB
    max_leases: int = 8
    aging_per_minute: float = 10.0
    slice: SliceWish = SliceWish.AUTO
    park_idle_after: float | None = None  # seconds; None: never parked for being idle


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
    park_when_memory_needed: bool = True  # idle sessions are checkpointed for a request
    park_host_limit: HostShare = HALF_THE_HOST  # host memory parks may take
    mps: bool = False  # an MPS daemon serves the GPUs: shares become MPS limits

    def limits_for(self, user: str, groups: tuple[str, ...]) -> Limits:
        limits = self.defaults
        for group, section in self.groups.items():  # file order, as documented
            if group in groups:
                limits = _apply(limits, section, f"groups.{group}")
        if user in self.users:
            limits = _apply(limits, self.users[user], f"users.{user}")
        return limits

    @property
    def parks_idle_sessions(self) -> bool:
        """Whether anyone's limits set ``park_idle_after`` (else the tick need not look)."""
        sections = (*self.groups.values(), *self.users.values())
        return self.defaults.park_idle_after is not None or any(
            section.get("park_idle_after") is not None for section in sections
        )

    def is_admin(self, uid: int, user: str, groups: tuple[str, ...]) -> bool:
        return uid == 0 or user in self.admin_users or any(g in self.admin_groups for g in groups)


def _apply(
    limits: Limits, section: Mapping[str, object], where: str, source: str = "policy"
) -> Limits:
    # Sections from a file are already converted, and converting again is a no-op; a
    # Policy built in code gets its raw sections checked here, on first use.
    return replace(limits, **schema.read_limits(section, where, source))


def parse_policy(text: str, source: str = "policy") -> Policy:
    """Policy from TOML text; PolicyError (one line) names the offending key."""
    return policy_from_document(parse_document(text, source), source)


def policy_from_document(document: Mapping[str, object], source: str = "policy") -> Policy:
    """Policy from a parsed TOML document.

    The whole ``[broker]`` table is checked, not just its policy keys, so a policy read
    alone (``gpushare admin set-policy``) is refused for the same typos as the broker's
    config; config.py checking that table again costs microseconds.
    """
    tables = schema.sections(document, source)
    broker = schema.read_broker(tables.broker, source)
    defaults = _apply(Limits(), tables.defaults, "defaults", source)
    groups = {
        name: schema.read_limits(section, f"groups.{schema.key_text(name)}", source)
        for name, section in tables.groups.items()
    }
    users = {
        name: schema.read_limits(section, f"users.{schema.key_text(name)}", source)
        for name, section in tables.users.items()
    }
    policy_keys = {key: broker[key] for key in schema.POLICY_BROKER_KEYS if key in broker}
    return Policy(defaults=defaults, groups=groups, users=users, **policy_keys)  # type: ignore[arg-type]


# ------------------------------------------------------------------ decisions


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


class StopCause(Enum):
    """Why the core stops a lease, which decides how far up the ladder it goes."""

    MAKE_ROOM = "make room"  # a higher band needs its turn on the GPU: stop its work
    FREE_MEMORY = "free memory"  # its device memory must leave the GPU: evict it
    OVER_QUOTA = "over quota"  # the watchdog holds a lease using more than it leased


def ladder_level(
    cause: StopCause,
    stopping: Sequence[VictimTraits],
    applied: PreemptionLevel | None = None,
) -> PreemptionLevel | None:
    """The ladder level the core asks for to stop a lease, or None if nothing can.

    ``stopping`` is the lease and whatever must stop with it (the running ranks of its
    gang: the highest level any of them needs stops them all).  ``applied`` is a level
    already applied or asked for, which is asked for again (a lease paused before the
    broker restarted is paused as it was).  Memory that must leave the GPU is evicted;
    a lease over its memory quota is locked (the gate or the yield flag would not stop
    it from holding memory), or left running if it cannot be.
    """
    if applied is not None:
        return applied
    if cause is StopCause.FREE_MEMORY:
        return PreemptionLevel.EVICT
    if cause is StopCause.OVER_QUOTA:
        return PreemptionLevel.LOCK if all(t.lockable for t in stopping) else None
    levels = [stopping_level(traits) for traits in stopping]
    if any(level is None for level in levels):
        return None
    return max(levels)  # type: ignore[type-var]


def lock_kept_when_failing(level: PreemptionLevel, parks: bool) -> bool:
    """Whether a stop at ``level`` that fails keeps the lock it took.

    A failed eviction keeps it: the lease stays paused, its memory on the device.  A
    failed park is undone whole, since the idle session must be able to run again, and
    so is a failed pause, whose lease runs on, time-sliced with the newcomer.
    """
    return level == PreemptionLevel.EVICT and not parks


def victim_order_key(priority: float, memory_bytes: int, started_seq: int) -> tuple:
    """Victims are taken lowest priority first, then the most memory, then the newest."""
    return (priority, -memory_bytes, -started_seq)
