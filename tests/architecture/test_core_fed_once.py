"""Only the server feeds the scheduler core; the broker's edges read it through a view.

The edges (``broker/edges/``) hold the core as ``BrokerContext.scheduler``, typed as
:class:`~gpushare_ext.broker.scheduler.core.CoreView`: the reads they make, no way to
change it.  Whatever they want done they post as an event on the context's queue, which
the server feeds to the core.
"""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from gpushare_ext.broker.edges import context
from gpushare_ext.broker.edges.context import BrokerContext
from gpushare_ext.broker.scheduler import core

EDGES = Path(__file__).resolve().parents[2] / "gpushare_ext" / "broker" / "edges"


def _core_handle_calls(path: Path) -> list[str]:
    """The calls of ``path`` that hand the core an event: ``<...scheduler or core>.handle(...)``."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.name}:{node.lineno}: {ast.unparse(node.func)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "handle"
        and any(word in ast.unparse(node.func.value) for word in ("scheduler", "core"))
    ]


def test_the_edges_hold_the_core_as_a_view():
    hints = typing.get_type_hints(BrokerContext, vars(context))
    assert hints["scheduler"] is core.CoreView


def test_the_scheduler_offers_every_read_of_the_view():
    wanted = {name for name, _ in inspect.getmembers(core.CoreView) if not name.startswith("_")}
    assert wanted and all(hasattr(core.Scheduler, name) for name in wanted), sorted(
        name for name in wanted if not hasattr(core.Scheduler, name)
    )
    assert "handle" not in wanted


def test_only_the_server_feeds_the_core_events():
    feeding = [call for path in sorted(EDGES.glob("*.py")) for call in _core_handle_calls(path)]
    assert len(feeding) == 1 and feeding[0].startswith("server.py:"), feeding  # dispatch
    assert feeding[0].endswith("self.core.handle"), feeding
