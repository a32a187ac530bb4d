"""The house rules of the package's layout (docs/design.md, "The rooms"), checked on its
source: each room imports only from the rooms below it, and no imports form a cycle, not
even imports made inside a function or only for type checking (a circle that runs
through a deferred import is still two modules that cannot be understood apart).

Rooms, lowest first:

* the ground floor (``protocol``, ``devices``, ``units``, ``control_block``, ``client``,
  ``errors``, ``paths``, ``safe_fs``, ``lease_state``, ``plain_text``): imports nothing
  else of gpushare;
* ``kernels`` (the kernel compiler): the ground floor;
* ``broker`` and ``runtime``, side by side: the ground floor and ``kernels``, never
  each other.  The broker stands in wings, lowest first, each importing only the wings
  below it: its error base (``broker/errors.py``, the ground floor alone), ``settings``
  (the TOML schema, the config, the policy), ``scheduler`` (the pure core and its parts;
  no ``kernels``), ``hands`` (what touches the machine) and ``edges`` (what the server
  runs); no other module stands loose in ``broker/``;
* the rooms at the top (``magics``, ``widgets``, ``status_view``, ``server_ext``,
  ``cli``, ``demo`` and the package itself): anything below.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpushare_ext"
GROUND = {
    "protocol",
    "devices",
    "units",
    "control_block",
    "client",
    "paths",
    "safe_fs",
    "errors",
    "lease_state",
    "plain_text",
}
# The broker's wings, lowest first; its own root holds the error base alone ("broker").
BROKER_WINGS = ("settings", "scheduler", "hands", "edges")
ALLOWED: dict[str, set[str]] = {
    "ground": {"ground"},
    "kernels": {"ground", "kernels"},
    "broker": {"ground", "broker"},
    "broker.settings": {"ground", "broker", "broker.settings"},
    "broker.scheduler": {"ground", "broker", "broker.settings", "broker.scheduler"},
    "broker.hands": {
        *("ground", "kernels", "broker", "broker.settings", "broker.scheduler"),
        "broker.hands",
    },
    "broker.edges": {
        *("ground", "kernels", "broker", "broker.settings", "broker.scheduler"),
        *("broker.hands", "broker.edges"),
    },
    "runtime": {"ground", "kernels", "runtime"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    if parts[1] in GROUND:
        return "ground"
    if parts[1] == "broker" and len(parts) > 2 and parts[2] in BROKER_WINGS:
        return f"broker.{parts[2]}"
    return parts[1] if parts[1] in ALLOWED else "top"


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported gpushare module, at module level?) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.split(".")[0] == "gpushare_ext":
                found.append((name, id(node) in top_level))
    return found


def graph() -> dict[str, list[tuple[str, bool]]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    for module, path in modules.items():
        for target, at_top in imports(path):
            # "from gpushare_ext.x import y": y is a module if there is such a file.
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != module:
                edges[module].append((target, at_top))
    return edges


def upward_arrows(edges: dict[str, list[tuple[str, bool]]]) -> list[str]:
    arrows = set()
    for module, targets in edges.items():
        allowed = ALLOWED.get(room(module))
        if allowed is None:
            continue
        arrows |= {f"{module} -> {t}" for t, _ in targets if room(t) not in allowed}
    return sorted(arrows)


def test_every_room_imports_only_from_below():
    upward = upward_arrows(graph())
    assert not upward, "imports from a higher room:\n" + "\n".join(upward)


def test_the_rules_see_an_arrow_up_and_between_peers():
    edges = {
        "gpushare_ext.protocol": [("gpushare_ext.broker.hands.inventory", True)],
        "gpushare_ext.kernels.launch": [("gpushare_ext.runtime.gate", False)],
        "gpushare_ext.runtime.session": [("gpushare_ext.broker.settings.policy", True)],
        "gpushare_ext.broker.hands.actuators": [("gpushare_ext.kernels.launch", False)],
        "gpushare_ext.magics.gpu": [("gpushare_ext.runtime.session", True)],
    }
    assert upward_arrows(edges) == [
        "gpushare_ext.kernels.launch -> gpushare_ext.runtime.gate",
        "gpushare_ext.protocol -> gpushare_ext.broker.hands.inventory",
        "gpushare_ext.runtime.session -> gpushare_ext.broker.settings.policy",
    ]


def test_the_rules_see_an_arrow_up_between_the_broker_s_wings():
    edges = {
        "gpushare_ext.broker.scheduler.core": [
            ("gpushare_ext.broker.hands.inventory", True),
            ("gpushare_ext.broker.settings.policy", True),
            ("gpushare_ext.broker.errors", True),
        ],
        "gpushare_ext.broker.scheduler.mig": [("gpushare_ext.kernels.ptx", False)],
        "gpushare_ext.broker.settings.policy": [("gpushare_ext.broker.scheduler.core", False)],
        "gpushare_ext.broker.hands.journal": [("gpushare_ext.broker.edges.records", False)],
        "gpushare_ext.broker.hands.history": [("gpushare_ext.broker.scheduler.core", True)],
        "gpushare_ext.broker.edges.server": [("gpushare_ext.broker.hands.journal", True)],
        "gpushare_ext.broker.errors": [("gpushare_ext.broker.settings.schema", True)],
        "gpushare_ext.broker.loose": [("gpushare_ext.broker.scheduler.core", True)],
    }
    assert upward_arrows(edges) == [
        "gpushare_ext.broker.errors -> gpushare_ext.broker.settings.schema",
        "gpushare_ext.broker.hands.journal -> gpushare_ext.broker.edges.records",
        "gpushare_ext.broker.loose -> gpushare_ext.broker.scheduler.core",
        "gpushare_ext.broker.scheduler.core -> gpushare_ext.broker.hands.inventory",
        "gpushare_ext.broker.scheduler.mig -> gpushare_ext.kernels.ptx",
        "gpushare_ext.broker.settings.policy -> gpushare_ext.broker.scheduler.core",
    ]


def test_every_broker_module_stands_in_a_wing():
    broker = PACKAGE / "broker"
    loose = sorted(
        p.name for p in broker.glob("*.py") if p.name not in {"__init__.py", "errors.py"}
    )
    folders = sorted(p.parent.name for p in broker.glob("*/__init__.py"))
    assert not loose, f"broker modules outside a wing: {loose}"
    assert folders == sorted(BROKER_WINGS), (
        f"broker/ holds {folders}, the rules know {BROKER_WINGS}"
    )
    assert all(list((broker / wing).glob("*.py")) for wing in BROKER_WINGS)


def import_cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets, each as the modules along it."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        stack.append(module)
        for target in edges.get(module, []):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    # A package's __init__ importing its own submodules is how a package exports them: an
    # arrow from a submodule up to its package is followed to the module it names instead.
    return [c for c in cycles if not any(_is_package_of(a, b) for a, b in itertools.pairwise(c))]


def _is_package_of(module: str, target: str) -> bool:
    return target.startswith(module + ".") or module.startswith(target + ".")


def test_no_imports_form_a_cycle_not_even_deferred_ones():
    edges = {m: sorted({t for t, _ in ts}) for m, ts in graph().items()}
    cycles = import_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_cycle_through_an_import_inside_a_function_is_seen():
    edges = {
        "gpushare_ext.kernels.frontends": ["gpushare_ext.kernels.toolchain"],
        "gpushare_ext.kernels.toolchain": ["gpushare_ext.kernels.frontends"],  # deferred
        "gpushare_ext.kernels": ["gpushare_ext.kernels.launch"],
        "gpushare_ext.kernels.launch": ["gpushare_ext.kernels"],  # the package's exports
    }
    assert import_cycles(edges) == [
        [
            "gpushare_ext.kernels.frontends",
            "gpushare_ext.kernels.toolchain",
            "gpushare_ext.kernels.frontends",
        ]
    ]
