"""MIG planning: propose a layout of GPU instances for the demand, explain it, print the commands.

``gpushare mig plan`` looks at one device and at what the leases ask for (memory, and
SMs where a lease wished for a share), and proposes how to cut the device into MIG
instances.  It follows the device's own rules: each profile occupies ``memory_slices``
of the 8 memory slices starting at one of its allowed ``placements``, all instances
together use at most the device's 7 compute slices, and no profile is used more often
than its ``instance_count``.

Theory of operation
-------------------
A few candidate layouts are built, each by a simple rule a person could follow by hand:

* **keep the current instances** (when some exist) and cut new ones only from the free
  slices -- nothing running is disturbed;
* **best fit**: one instance per lease, the smallest profile that holds it;
* **best fit, then sharing**: as best fit, then leases that found no room share an
  instance that has memory to spare (they time-slice its SMs);
* **fewest instances**: pack the leases into as few instances as possible.

The candidates are compared by (leases served, leases that share an instance, memory cut
but not asked for, whether the current instances must be destroyed, instances): serving
more leases comes first; among layouts that serve as many, isolation (MIG's point) beats
saving memory, and leaving running work alone breaks the tie.  The earliest candidate wins
a tie, and the explanation says in sentences what fits, what waits, what is wasted and why
the other candidates lost.

This module only *plans*, and everything in it is pure: it never touches a GPU, runs a
command or asks a broker.  The command (``gpushare_ext/mig_command.py``) prints the plan
and the ``nvidia-smi`` commands an admin would run; it runs them only with ``--apply``,
never on a simulated inventory and never while a lease runs on the device (destroying
instances kills whatever runs in them); :func:`check_can_apply` says why not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.devices import MIB, DeviceInfo, MigInstance, MigProfile
from gpushare_ext.units import format_size, parse_size

MEMORY_SLICES = 8  # memory slices of an A100/H100/H200 (profiles' placements live on these)


class MigPlanError(DaemonError):
    """The plan cannot be made or applied; the message says why, in one line.

    ``exit_code`` is 2 for bad usage (a wrong size, a missing option) and 1 otherwise.
    """

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


# ------------------------------------------------------------------ data


class Demand(msgspec.Struct, frozen=True, kw_only=True):
    """What one lease asks for: memory, and SMs when it wished for a share of them."""

    memory_bytes: int
    sms: int | None = None
    label: str = ""
    running: bool = False  # it runs now (queued otherwise)
    mig_uuid: str | None = None  # the instance it runs in, when it does

    def describe(self) -> str:
        text = format_size(self.memory_bytes)
        if self.sms:
            text += f" + {self.sms} SMs"
        return f"{self.label} ({text})" if self.label else text


class PlannedInstance(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU instance of a proposed layout and the leases (demand indices) it would serve."""

    profile: MigProfile
    start: int
    serves: tuple[int, ...] = ()
    existing_uuid: str | None = None  # set when the instance exists already and is kept

    @property
    def end(self) -> int:
        return self.start + self.profile.memory_slices

    @property
    def memory_bytes(self) -> int:
        return self.profile.memory_mib * MIB


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One way to cut the device, with what it serves and what it wastes."""

    name: str
    rule: str  # the rule in a sentence
    instances: tuple[PlannedInstance, ...]
    waiting: tuple[int, ...]  # demand indices that find no room
    wasted_bytes: int  # memory of instances serving leases, beyond what those leases asked
    destroys_current: bool  # the current instances must be destroyed first
    shared_leases: int  # leases that share an instance with another lease

    @property
    def served(self) -> int:
        return sum(len(i.serves) for i in self.instances)

    @property
    def compute_slices(self) -> int:
        return sum(i.profile.slice_count for i in self.instances)

    def score(self) -> tuple:
        return (
            -self.served,
            self.shared_leases,
            self.wasted_bytes,
            self.destroys_current,
            len(self.instances),
        )

    def same_layout_as(self, other: Candidate) -> bool:
        return [(i.profile.id, i.start, i.serves) for i in self.instances] == [
            (i.profile.id, i.start, i.serves) for i in other.instances
        ]


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """The proposal for one device: the chosen layout, the others, the words and the commands."""

    device_index: int
    device_name: str
    simulated: bool
    mig_enabled: bool
    demand: tuple[Demand, ...]
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    explanation: tuple[str, ...]
    commands: tuple[str, ...]
    running_leases: int

    @property
    def waiting(self) -> tuple[Demand, ...]:
        return tuple(self.demand[i] for i in self.chosen.waiting)


# ------------------------------------------------------------------ layout rules


def _usable_profiles(device: DeviceInfo) -> list[MigProfile]:
    """Profiles worth planning with: the media-extension variants are left to admins."""
    return sorted(
        (p for p in device.profiles if not p.media_extensions and p.placements),
        key=lambda p: (p.memory_mib, p.slice_count, p.multiprocessor_count, p.memory_slices),
    )


def compute_slices_total(device: DeviceInfo) -> int:
    """Compute slices of the device: those of its largest profile (7 on an H200)."""
    return max((p.slice_count for p in device.profiles), default=0)


def _holds(profile: MigProfile, demands: Iterable[Demand]) -> bool:
    demands = list(demands)
    memory = sum(d.memory_bytes for d in demands)
    sms = max((d.sms or 0 for d in demands), default=0)
    return memory <= profile.memory_mib * MIB and sms <= profile.multiprocessor_count


def fitting_profiles(device: DeviceInfo, demands: Sequence[Demand]) -> list[MigProfile]:
    """Profiles that hold these leases together, smallest first."""
    return [p for p in _usable_profiles(device) if _holds(p, demands)]


def place(
    device: DeviceInfo, profiles: Sequence[MigProfile], kept: Sequence[PlannedInstance] = ()
) -> list[int] | None:
    """Start slices for ``profiles`` beside the ``kept`` instances, or None if impossible.

    Respects the allowed starts, overlaps, the compute slices and the instance counts.
    The answer is in the order of ``profiles``.
    """
    counts: dict[int, int] = {}
    for item in [*kept, *(PlannedInstance(profile=p, start=0) for p in profiles)]:
        counts[item.profile.id] = counts.get(item.profile.id, 0) + 1
    limits = {p.id: p.instance_count for p in device.profiles}
    if any(n > limits.get(pid, 0) for pid, n in counts.items()):
        return None
    compute = sum(k.profile.slice_count for k in kept) + sum(p.slice_count for p in profiles)
    if compute > compute_slices_total(device):
        return None
    used = [False] * MEMORY_SLICES
    for k in kept:
        for s in range(k.start, k.end):
            used[s] = True
    order = sorted(range(len(profiles)), key=lambda i: -profiles[i].memory_slices)
    starts: dict[int, int] = {}

    def search(position: int) -> bool:
        if position == len(order):
            return True
        which = order[position]
        profile = profiles[which]
        for start in profile.placements:
            span = range(start, start + profile.memory_slices)
            if span.stop > MEMORY_SLICES or any(used[s] for s in span):
                continue
            for s in span:
                used[s] = True
            starts[which] = start
            if search(position + 1):
                return True
            for s in span:
                used[s] = False
        return False

    if not search(0):
        return None
    return [starts[i] for i in range(len(profiles))]


def check_layout(device: DeviceInfo, instances: Sequence[PlannedInstance]) -> list[str]:
    """Every way ``instances`` break the device's rules (empty when the layout is valid)."""
    problems = []
    used: dict[int, int] = {}
    for n, inst in enumerate(instances):
        p = inst.profile
        if inst.start not in p.placements:
            problems.append(f"{p.name} may not start at memory slice {inst.start}")
        if inst.end > MEMORY_SLICES:
            problems.append(f"{p.name} at {inst.start} runs past the last memory slice")
        for s in range(inst.start, min(inst.end, MEMORY_SLICES)):
            if s in used:
                problems.append(f"memory slice {s} is used by instances {used[s]} and {n}")
            used[s] = n
    for p in device.profiles:
        count = sum(1 for i in instances if i.profile.id == p.id)
        if count > p.instance_count:
            problems.append(f"{count} × {p.name}, but at most {p.instance_count} allowed")
    compute = sum(i.profile.slice_count for i in instances)
    if compute > compute_slices_total(device):
        problems.append(
            f"{compute} compute slices, but the device has {compute_slices_total(device)}"
        )
    return problems


# ------------------------------------------------------------------ candidate layouts


def _order(demand: Sequence[Demand]) -> list[int]:
    """Who is served first: running leases, then the biggest (they are hardest to place)."""
    return sorted(
        range(len(demand)), key=lambda i: (not demand[i].running, -demand[i].memory_bytes, i)
    )


def _finish(
    device: DeviceInfo,
    name: str,
    rule: str,
    demand: Sequence[Demand],
    groups: list[tuple[MigProfile, list[int], str | None, int | None]],
    kept: Sequence[PlannedInstance] = (),
    destroys: bool = False,
) -> Candidate:
    """Turn (profile, leases, existing uuid, fixed start) groups into a placed Candidate."""
    new = [g for g in groups if g[2] is None]
    starts = place(device, [g[0] for g in new], kept)
    assert starts is not None, "a candidate rule produced an unplaceable layout"
    instances = []
    start_of_new = iter(starts)
    for profile, serves, uuid, fixed in groups:
        start = fixed if uuid is not None else next(start_of_new)
        instances.append(
            PlannedInstance(profile=profile, start=start, serves=tuple(serves), existing_uuid=uuid)
        )
    instances.sort(key=lambda i: i.start)
    served = {i for inst in instances for i in inst.serves}
    wasted = sum(
        inst.memory_bytes - sum(demand[i].memory_bytes for i in inst.serves)
        for inst in instances
        if inst.serves
    )
    return Candidate(
        name=name,
        rule=rule,
        instances=tuple(instances),
        waiting=tuple(i for i in range(len(demand)) if i not in served),
        wasted_bytes=wasted,
        destroys_current=destroys,
        shared_leases=sum(len(inst.serves) for inst in instances if len(inst.serves) > 1),
    )


def _best_fit_groups(
    device: DeviceInfo,
    demand: Sequence[Demand],
    order: Sequence[int],
    kept: Sequence[PlannedInstance],
) -> list[tuple[MigProfile, list[int], str | None, int | None]]:
    groups: list[tuple[MigProfile, list[int], str | None, int | None]] = []
    for i in order:
        for profile in fitting_profiles(device, [demand[i]]):
            trial = [g[0] for g in groups] + [profile]
            if place(device, trial, kept) is not None:
                groups.append((profile, [i], None, None))
                break
    return groups


def _share_leftovers(
    device: DeviceInfo,
    demand: Sequence[Demand],
    groups: list[tuple[MigProfile, list[int], str | None, int | None]],
) -> bool:
    """Put leases without an instance into the tightest instance that still holds them."""
    placed = {i for g in groups for i in g[1]}
    changed = False
    for i in _order(demand):
        if i in placed:
            continue
        roomy = [g for g in groups if _holds(g[0], [demand[j] for j in g[1]] + [demand[i]])]
        if not roomy:
            continue
        tightest = min(
            roomy,
            key=lambda g: g[0].memory_mib * MIB - sum(demand[j].memory_bytes for j in g[1]),
        )
        tightest[1].append(i)
        placed.add(i)
        changed = True
    return changed


def _keep_current(device: DeviceInfo, demand: Sequence[Demand]) -> Candidate:
    by_id = {p.id: p for p in device.profiles}
    groups: list[tuple[MigProfile, list[int], str | None, int | None]] = []
    index_of: dict[str, int] = {}
    for inst in sorted(device.instances, key=lambda i: i.start):
        profile = by_id.get(inst.profile_id) or _profile_of_instance(inst)
        index_of[inst.uuid] = len(groups)
        groups.append((profile, [], inst.uuid, inst.start))
    placed: set[int] = set()
    for i, d in enumerate(demand):  # a running lease stays where it runs
        if d.mig_uuid in index_of:
            groups[index_of[d.mig_uuid]][1].append(i)
            placed.add(i)
    for i in _order(demand):
        if i in placed:
            continue
        free = [g for g in groups if not g[1] and _holds(g[0], [demand[i]])]
        if free:
            min(free, key=lambda g: g[0].memory_mib)[1].append(i)
            placed.add(i)
    kept = [PlannedInstance(profile=g[0], start=g[3] or 0, existing_uuid=g[2]) for g in groups]
    rest = [i for i in _order(demand) if i not in placed]
    groups += _best_fit_groups(device, demand, rest, kept)
    _share_leftovers(device, demand, groups)
    return _finish(
        device,
        "keep the current instances",
        "the instances that exist stay as they are (nothing running is disturbed); "
        "new ones are cut from the free slices only; leases left without room share the "
        "instance with the least memory to spare",
        demand,
        groups,
        kept,
    )


def _profile_of_instance(inst: MigInstance) -> MigProfile:
    return MigProfile(
        id=inst.profile_id,
        name=inst.name,
        slice_count=1,
        memory_mib=inst.memory_mib,
        multiprocessor_count=inst.multiprocessor_count,
        instance_count=1,
        memory_slices=inst.size,
        placements=(inst.start,),
    )


def _fewest_instances(device: DeviceInfo, demand: Sequence[Demand]) -> Candidate:
    """First-fit decreasing into the largest profile that can still be cut, then shrink."""
    bins: list[list[int]] = []
    profiles: list[MigProfile] = []
    for i in _order(demand):
        for n, members in enumerate(bins):
            bigger = [
                p for p in fitting_profiles(device, [demand[j] for j in members] + [demand[i]])
                if place(device, [*profiles[:n], p, *profiles[n + 1 :]]) is not None
            ]  # fmt: skip
            if bigger:
                members.append(i)
                profiles[n] = bigger[-1]
                break
        else:
            options = [
                p for p in fitting_profiles(device, [demand[i]])
                if place(device, [*profiles, p]) is not None
            ]  # fmt: skip
            if options:
                bins.append([i])
                profiles.append(options[-1])
    for n, members in enumerate(bins):  # shrink each instance to what it holds
        for p in fitting_profiles(device, [demand[j] for j in members]):
            if place(device, [*profiles[:n], p, *profiles[n + 1 :]]) is not None:
                profiles[n] = p
                break
    groups = [(p, m, None, None) for p, m in zip(profiles, bins, strict=True)]
    return _finish(
        device,
        "fewest instances",
        "leases are packed into as few instances as possible, each shrunk to the "
        "smallest profile that holds its leases (leases in one instance time-slice it)",
        demand,
        groups,  # type: ignore[arg-type]
        destroys=bool(device.instances),
    )


def candidate_layouts(device: DeviceInfo, demand: Sequence[Demand]) -> list[Candidate]:
    """Every candidate layout for ``demand`` on ``device``, in the order ties are broken."""
    candidates = []
    if device.instances:
        candidates.append(_keep_current(device, demand))
    order = _order(demand)
    best = _best_fit_groups(device, demand, order, ())
    destroys = bool(device.instances)
    candidates.append(
        _finish(
            device,
            "best fit",
            "one instance per lease, the smallest profile that holds it",
            demand,
            [(p, list(m), u, s) for p, m, u, s in best],
            destroys=destroys,
        )
    )
    shared = [(p, list(m), u, s) for p, m, u, s in best]
    if _share_leftovers(device, demand, shared):
        candidates.append(
            _finish(
                device,
                "best fit, then sharing",
                "one instance per lease, the smallest that holds it; leases left without "
                "room share the instance with the least memory to spare",
                demand,
                shared,
                destroys=destroys,
            )
        )
    candidates.append(_fewest_instances(device, demand))
    return candidates


# ------------------------------------------------------------------ the plan


def plan_layout(
    device: DeviceInfo, demand: list[Demand], *, running_leases: int | None = None
) -> Plan:
    """Propose a MIG layout of ``device`` for ``demand``; explain it and list the commands.

    ``running_leases`` is how many leases run on the device now (default: the demands
    marked running); the plan says it cannot be applied while any do.
    """
    if not _usable_profiles(device):
        raise MigPlanError(
            f"GPU {device.index} ({device.name}) reports no MIG profiles: it cannot be cut "
            "into MIG instances"
        )
    demand = list(demand)
    running = sum(d.running for d in demand) if running_leases is None else running_leases
    candidates = candidate_layouts(device, demand)
    chosen = min(candidates, key=Candidate.score)  # min is stable: earlier candidates win ties
    explanation = _explain(device, demand, chosen, candidates, running)
    return Plan(
        device_index=device.index,
        device_name=device.name,
        simulated=device.simulated,
        mig_enabled=device.mig_enabled,
        demand=tuple(demand),
        chosen=chosen,
        candidates=tuple(candidates),
        explanation=tuple(explanation),
        # No demand asks for no change: enabling MIG for nobody is not a step to take.
        commands=tuple(admin_commands(device, chosen)) if demand else (),
        running_leases=running,
    )


def admin_commands(device: DeviceInfo, chosen: Candidate) -> list[str]:
    """The nvidia-smi lines that turn the current layout into ``chosen`` (run as root)."""
    gpu = device.index
    commands = []
    if not device.mig_enabled:
        commands.append(f"nvidia-smi -i {gpu} -mig 1")
    if chosen.destroys_current and device.instances:
        commands.append(f"nvidia-smi mig -i {gpu} -dci")
        commands.append(f"nvidia-smi mig -i {gpu} -dgi")
    new = [i for i in chosen.instances if i.existing_uuid is None]
    # Largest first: the driver then finds room for every instance of a valid layout.
    new.sort(key=lambda i: (-i.profile.memory_slices, i.start))
    if new:
        ids = ",".join(str(i.profile.id) for i in new)
        commands.append(f"nvidia-smi mig -i {gpu} -cgi {ids} -C")
    return commands


def _names(instances: Iterable[PlannedInstance]) -> str:
    counts: dict[str, int] = {}
    for inst in instances:
        counts[inst.profile.name] = counts.get(inst.profile.name, 0) + 1
    return " + ".join(f"{n} × {name}" if n > 1 else name for name, n in counts.items())


def _current_layout(device: DeviceInfo) -> str:
    if device.instances:
        return f"its current layout is {_names(_as_planned(device))}"
    if device.mig_enabled:
        return "MIG is on but no instance exists yet"
    return "MIG is off (the GPU is used whole)"


def _instance_line(inst: PlannedInstance, demand: Sequence[Demand]) -> str:
    """One instance of the chosen layout: where, kept or new, its size, whom it serves."""
    who = ", ".join(demand[i].describe() for i in inst.serves) or "nobody yet"
    state = "kept" if inst.existing_uuid else "new"
    where = (
        f"memory slice {inst.start}"
        if inst.end - inst.start == 1
        else f"memory slices {inst.start}-{inst.end - 1}"
    )
    return (
        f"  {inst.profile.name} at {where} ({state}, "
        f"{format_size(inst.memory_bytes)}, {inst.profile.multiprocessor_count} SMs): {who}"
    )


def _fit_lines(device: DeviceInfo, demand: Sequence[Demand], chosen: Candidate) -> list[str]:
    """Whether every lease fits, else which wait and why."""
    if not chosen.waiting:
        return [f"Every lease fits ({chosen.served} of {len(demand)})."]
    lines = [
        f"{chosen.served} of {len(demand)} leases fit; {len(chosen.waiting)} would have to wait:"
    ]
    biggest = max(_usable_profiles(device), key=lambda p: p.memory_mib)
    for i in chosen.waiting:
        d = demand[i]
        if not fitting_profiles(device, [d]):
            why = (
                f"more than the largest profile ({biggest.name}, "
                f"{format_size(biggest.memory_mib * MIB)}, {biggest.multiprocessor_count} SMs)"
                " holds; it needs a whole GPU with MIG off"
            )
        else:
            why = "no instance that holds it can be cut beside the others"
        lines.append(f"  {d.describe()} waits: {why}.")
    return lines


def _explain(
    device: DeviceInfo,
    demand: Sequence[Demand],
    chosen: Candidate,
    candidates: Sequence[Candidate],
    running: int,
) -> list[str]:
    lines = []
    gpu = f"GPU {device.index} ({device.name}{', simulated' if device.simulated else ''})"
    current = _current_layout(device)
    if not demand:
        lines.append(f"No lease asks for memory on {gpu}; {current}. Nothing to plan.")
        return lines
    queued = len(demand) - sum(d.running for d in demand)
    lines.append(
        f"{gpu}: {current}. Demand: {len(demand)} lease(s) "
        f"({len(demand) - queued} running, {queued} queued): "
        + ", ".join(d.describe() for d in demand)
        + "."
    )
    lines.append(f"Chosen layout: {chosen.name} -- {chosen.rule}.")
    lines += [_instance_line(inst, demand) for inst in chosen.instances]
    lines += _fit_lines(device, demand, chosen)
    total = compute_slices_total(device)
    free_slices = total - chosen.compute_slices
    lines.append(
        f"Waste: {format_size(chosen.wasted_bytes)} of instance memory is not asked for; "
        f"{free_slices} of {total} compute slices stay uncut for later."
    )
    if chosen.shared_leases:
        lines.append(
            f"{chosen.shared_leases} leases share an instance: they time-slice its SMs and are "
            "not isolated from each other."
        )
    for other in candidates:
        if other is chosen:
            continue
        lines.append(f"Not {other.name}: {_why_not(chosen, other)}.")
    if chosen.destroys_current and device.instances:
        lines.append(
            f"The current instances must be destroyed first: every lease on GPU {device.index} "
            "must have ended."
        )
    if running:
        lines.append(
            f"{running} lease(s) run on GPU {device.index} now; apply only when they have ended "
            f"(gpushare admin drain {device.index} stops new grants)."
        )
    return lines


def _why_not(chosen: Candidate, other: Candidate) -> str:
    if other.served < chosen.served:
        return f"it serves {other.served} lease(s) instead of {chosen.served}"
    if other.same_layout_as(chosen):
        if other.destroys_current and not chosen.destroys_current:
            return "it comes to the same layout, but destroys and recreates the instances"
        return "it comes to the same layout"
    if other.shared_leases > chosen.shared_leases:
        return (
            f"it serves no more and makes {other.shared_leases} leases share an instance "
            "(they would time-slice it, without isolation)"
        )
    if other.wasted_bytes > chosen.wasted_bytes:
        return (
            f"it cuts {format_size(other.wasted_bytes - chosen.wasted_bytes)} more memory than "
            "the leases ask for"
        )
    if other.destroys_current and not chosen.destroys_current:
        return "it serves no more and would destroy the current instances"
    if other.score()[:4] == chosen.score()[:4]:
        return "it serves as many with the same waste; the rule listed first wins the tie"
    return "it scores lower"


def _as_planned(device: DeviceInfo) -> list[PlannedInstance]:
    by_id = {p.id: p for p in device.profiles}
    return [
        PlannedInstance(
            profile=by_id.get(i.profile_id) or _profile_of_instance(i),
            start=i.start,
            existing_uuid=i.uuid,
        )
        for i in sorted(device.instances, key=lambda i: i.start)
    ]


def layout_map(instances: Sequence[PlannedInstance]) -> str:
    """The 8 memory slices as text, e.g. ``|2g.35gb| 1g| 1g|    3g.71gb    |``; '.' = free."""
    cells = []
    position = 0
    for inst in sorted(instances, key=lambda i: i.start):
        cells.extend("." for _ in range(position, inst.start))
        width = inst.profile.memory_slices * 4 - 1
        name = inst.profile.name
        label = name if len(name) <= width else name.split(".")[0]
        cells.append(label[:width].center(width))
        position = inst.end
    cells.extend("." for _ in range(position, MEMORY_SLICES))
    return "|" + "|".join(c if c != "." else " . " for c in cells) + "|"


def render_plan(plan: Plan) -> str:
    """The plan as a person reads it: explanation, map, commands and how to apply."""
    lines = list(plan.explanation)
    if not plan.demand:
        return "\n".join(lines)  # "Nothing to plan." is all there is to say
    lines.append("")
    lines.append("Memory slices 0-7: " + layout_map(plan.chosen.instances))
    lines.append("")
    if plan.commands:
        lines.append("Commands (as root; nvidia-smi places the instances):")
        lines.extend(f"  {c}" for c in plan.commands)
        lines.append("Then restart the broker so it reads the new instances.")
        if plan.simulated:
            lines.append("This inventory is simulated: the commands are for reading, not running.")
        else:
            lines.append("Nothing was changed; pass --apply to run them.")
    else:
        lines.append("No command to run: the current layout already serves this plan.")
    return "\n".join(lines)


def plan_to_builtins(plan: Plan) -> dict:
    """The plan as JSON-ready data (``--json``), including the derived fields."""
    data = msgspec.to_builtins(plan)
    data["served"] = plan.chosen.served
    data["waiting"] = [msgspec.to_builtins(d) for d in plan.waiting]
    data["layout_map"] = layout_map(plan.chosen.instances)
    return data


# ------------------------------------------------------------------ applying


def check_can_apply(plan: Plan) -> None:
    """Raise MigPlanError saying why this plan must not be applied; return if it may."""
    if plan.simulated:
        raise MigPlanError(
            f"refusing --apply: GPU {plan.device_index} is a simulated inventory, there is "
            "no real device to change"
        )
    if plan.running_leases:
        raise MigPlanError(
            f"refusing --apply: {plan.running_leases} lease(s) run on GPU {plan.device_index}; "
            "changing MIG instances would kill their work (drain the device and wait for them "
            "to end)"
        )
    if not plan.commands:
        raise MigPlanError("nothing to apply: the current layout already serves this plan")


# ------------------------------------------------------------------ demand


def parse_demand(text: str) -> list[Demand]:
    """``8GiB,40GiB:60sm`` -> demands; each item is a size, optionally ``:N`` or ``:Nsm``."""
    demands = []
    for n, item in enumerate(part.strip() for part in text.split(",")):
        if not item:
            raise MigPlanError(
                f"--demand item {n + 1} is empty (example: 8GiB,40GiB:60sm)", exit_code=2
            )
        size_text, _, sm_text = item.partition(":")
        try:
            memory = parse_size(size_text.strip())
        except ValueError as exc:
            raise MigPlanError(f"--demand: {exc}", exit_code=2) from exc
        if memory <= 0:
            raise MigPlanError(f"--demand: {item!r} asks for no memory", exit_code=2)
        sms = None
        if sm_text:
            digits = sm_text.strip().lower().removesuffix("sm").removesuffix("sms")
            if not (digits.isascii() and digits.isdecimal()) or int(digits) <= 0:
                raise MigPlanError(
                    f"--demand: {sm_text!r} is not a number of SMs (example: 40GiB:60sm)",
                    exit_code=2,
                )
            sms = int(digits)
        demands.append(Demand(memory_bytes=memory, sms=sms, label=f"#{n + 1}"))
    return demands


def check_demand_fits(device: DeviceInfo, demand: Sequence[Demand]) -> None:
    """Refuse (exit 2) an SM wish beyond the whole GPU: no layout, MIG or not, can serve it."""
    for n, d in enumerate(demand, start=1):
        if d.sms is not None and d.sms > device.multiprocessor_count:
            raise MigPlanError(
                f"--demand item {n} asks for {d.sms} SMs, more than GPU {device.index} "
                f"({device.name}) has; ask for at most {device.multiprocessor_count}sm",
                exit_code=2,
            )


def demand_from_snapshot(snapshot, device: DeviceInfo) -> tuple[list[Demand], int]:
    """Leases on ``device`` plus those still queued (they may land anywhere); and how many run."""
    instance_sms = {i.uuid: i.multiprocessor_count for i in device.instances}
    demands = []
    running = 0
    for lease in snapshot.leases:
        if lease.device_index not in (None, device.index):
            continue
        state = getattr(lease.state, "value", lease.state)
        is_running = state in ("running", "paused")
        if lease.device_index == device.index and is_running:
            running += 1
        sms = None
        if lease.sm_share < 1.0:
            base = instance_sms.get(lease.mig_uuid or "", device.multiprocessor_count)
            sms = max(1, math.ceil(lease.sm_share * base))
        demands.append(
            Demand(
                memory_bytes=lease.memory_bytes,
                sms=sms,
                label=lease.lease_id,
                running=is_running,
                mig_uuid=lease.mig_uuid,
            )
        )
    return demands, running
