"""One lease state machine: in the broker, only the transition module changes a lease's
state and its stop sub-state, and only ``lease_state.py`` says which state a stop at a
level results in.  Each check has a test of its own that it finds what it is meant to
find."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpushare_ext"
TRANSITION_MODULE = "broker/scheduler/lease_transitions.py"
# What only the transition function assigns (record constructors set them as keywords,
# which are not assignments).
GUARDED_FIELDS = frozenset(
    {
        "state",
        "state_since",
        "stop",
        "pending_level",
        "applied_level",
        "held_by_watchdog",
        "detached",
        "restore_wanted",
    }
)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _flattened(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [leaf for element in target.elts for leaf in _flattened(element)]
    return [target]


def guarded_assignments(source: str) -> list[tuple[int, str]]:
    """(line, field) of every assignment to a guarded attribute, ``setattr`` included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            for leaf in _flattened(target):
                if isinstance(leaf, ast.Attribute) and leaf.attr in GUARDED_FIELDS:
                    found.append((leaf.lineno, leaf.attr))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in GUARDED_FIELDS
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def _speaks_of_a_level(node: ast.AST) -> bool:
    """Whether ``node`` reads a level: ``PreemptionLevel.EVICT`` or a name with "level"."""
    for inner in ast.walk(node):
        name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
        if name == "EVICT" or "level" in name.lower():
            return True
    return False


def evicted_from_a_level(source: str) -> list[int]:
    """Lines that choose ``EVICTED`` by a condition on a ladder level."""
    found = [
        source.count("\n", 0, match.start()) + 1 for match in re.finditer(r"EVICTED\s+if\b", source)
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.IfExp | ast.If) and _speaks_of_a_level(node.test):
            chosen = [node.body, node.orelse] if isinstance(node, ast.IfExp) else node.body
            for part in chosen if isinstance(chosen, list) else [chosen]:
                for piece in part if isinstance(part, list) else [part]:
                    if any(
                        isinstance(inner, ast.Attribute) and inner.attr == "EVICTED"
                        for inner in ast.walk(piece)
                    ):
                        found.append(node.lineno)
    return sorted(set(found))


def test_only_the_transition_module_changes_a_lease_s_state_and_stop():
    wrong = [
        f"{path.relative_to(PACKAGE)}:{line} assigns .{field}"
        for path in sorted((PACKAGE / "broker").rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() != TRANSITION_MODULE
        for line, field in guarded_assignments(path.read_text())
    ]
    assert not wrong, "\n".join(wrong)


def test_only_lease_state_says_which_state_a_stop_results_in():
    wrong = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "lease_state.py" or path.parent != PACKAGE
        for line in evicted_from_a_level(path.read_text())
    ]
    assert not wrong, "derives EVICTED from a level: " + ", ".join(wrong)


# ---- the checks find what they are meant to find


def test_the_assignment_check_finds_every_kind_of_assignment():
    source = (
        "lease.pending_level = 3\n"
        "lease.state_since += 1.0\n"
        "a.x, lease.detached = 1, False\n"
        "setattr(lease, 'restore_wanted', True)\n"
        "lease.reason = 'not guarded'\n"
        "Lease(state=1, detached=True)\n"
    )
    assert guarded_assignments(source) == [
        (1, "pending_level"),
        (2, "state_since"),
        (3, "detached"),
        (4, "restore_wanted"),
    ]


def test_the_eviction_check_finds_a_state_derived_from_a_level():
    derived = (
        "state = LeaseState.EVICTED if level == PreemptionLevel.EVICT else LeaseState.PAUSED\n"
        "if action.level == PreemptionLevel.EVICT:\n"
        "    state = LeaseState.EVICTED\n"
    )
    assert evicted_from_a_level(derived) == [1, 2]
    read_only = (
        "on_host = lease.state == LeaseState.EVICTED or lease.pending_level == 4\n"
        "state = LeaseState.PAUSED if old == LeaseState.EVICTED else old\n"
    )
    assert evicted_from_a_level(read_only) == []
