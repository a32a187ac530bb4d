"""A parked notebook: restored before its next cell, whatever the cell is.

When the broker parks an idle session (its GPU memory checkpointed to host memory, the
process locked), every CUDA call of that process would block inside the driver.  So
the extension runs :func:`before_cell` at the top of *every* cell, marked ``%%gpu`` or
not (an AST transformer puts the call there: a ``pre_run_cell`` hook cannot stop a
cell, an exception raised at the cell's first line does):

* it tells the broker a cell started (a session with a cell running is never parked;
  ``post_run_cell`` says when it ended);
* if the session is parked, it asks for the memory back and shows one live line,
  ``gpushare: restoring 12.0 GiB parked 16 min ago ... 1.4 s``, then runs the cell.  If
  the memory is not free the restore waits in the broker's queue, and the line says
  where it stands; interrupting the kernel withdraws the restore, keeps the session
  parked and does not run the cell.  A restore that fails says what was lost.

Cells made only of ``%gpu`` line magics (status, release, ...) do not restore: they
never touch the GPU, and a parked notebook may want to look at the queue.

It must not talk to the broker but through the session's client, and must not import
the magics (they import it).  The session knows the park only as a record
(:mod:`parked`): the arrows run from here to the session, never back.
"""

from __future__ import annotations

import ast
import contextlib
import time
import uuid
from typing import Any

from gpushare_ext.client import BrokerError, BrokerUnavailable
from gpushare_ext.runtime import cell_lines
from gpushare_ext.runtime.cell_output import CellOutput
from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.runtime.parked import ParkedMemory
from gpushare_ext.runtime.session import GpuSession, existing_session


class RestoreFailed(SessionError):
    """The parked memory could not be brought back; the message says what was lost."""


def _restoring_line(park: ParkedMemory, what: str, waited_s: float) -> str:
    return cell_lines.restoring_line(
        what, waited_s, park.queued.reason if park.queued is not None else None
    )


def restore(session: GpuSession, park: ParkedMemory, output: CellOutput) -> None:
    """Bring ``park`` back, showing one live line; raises KeyboardInterrupt (withdrawn,
    still parked) or :class:`RestoreFailed`."""
    what = park.describe()
    key = f"gpushare-restore-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    try:
        client = session.connect()
    except BrokerUnavailable as exc:
        session.forget_park(park)
        output.show(key, cell_lines.restore_failed_line(what, exc))
        return
    if session.parked is not park:
        # The connection was new: a broker that starts restores every process its
        # journal held before it serves anyone, so nothing is parked any more.
        session.park_restored_by_restart = None
        output.show(key, cell_lines.restored_by_restart_line(what))
        return
    output.show(key, cell_lines.restore_starts_line(what))
    park.asked = True
    try:
        client.restore(park.lease_id)
    except (BrokerError, BrokerUnavailable) as exc:
        session.forget_park(park)
        output.show(key, cell_lines.restore_failed_line(what, exc))
        return
    last_shown = -1.0
    try:
        while not park.done.is_set():
            waited = time.monotonic() - started
            if waited - last_shown >= 1.0 or park.changed.is_set():
                output.show(key, _restoring_line(park, what, waited))
                last_shown = waited
            park.changed.clear()
            park.done.wait(0.1)  # short waits keep Ctrl-C responsive
    except KeyboardInterrupt:
        with contextlib.suppress(BrokerError, BrokerUnavailable):
            session.connect().restore(park.lease_id, cancel=True)
        park.queued = None
        park.asked = False
        output.show(key, cell_lines.restore_withdrawn_line(what))
        raise
    session.forget_park(park)
    if park.failed:
        output.show(key, cell_lines.notice(park.failed))
        raise RestoreFailed(cell_lines.notice(park.failed))
    output.show(key, cell_lines.restored_line(what, time.monotonic() - started))
    with contextlib.suppress(BrokerError, BrokerUnavailable):
        session.connect().release(park.lease_id)


# ------------------------------------------------------------------ the cell hooks


def _only_gpu_line_magics(tree: ast.Module) -> bool:
    """A cell of ``%gpu ...`` lines alone (IPython turns each into run_line_magic)."""
    if not tree.body:
        return False
    for statement in tree.body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "run_line_magic"
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and call.args[0].value in ("gpu", "gpuconfig")
        ):
            return False
    return True


class RestoreBeforeCell(ast.NodeTransformer):
    """Puts ``before_cell()`` first in every cell (IPython's ``ast_transformers``)."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        if _only_gpu_line_magics(node):
            return node
        call = ast.parse(
            "__import__('gpushare_ext.runtime.parking', fromlist=['before_cell']).before_cell()"
        ).body[0]
        node.body.insert(0, call)
        return ast.fix_missing_locations(node)


def before_cell() -> None:
    """Run at the top of every cell: say a cell started; restore a parked session."""
    session = existing_session()
    if session is None:
        return  # no %%gpu cell yet: the broker does not know this notebook
    session.cell_activity(running=True)
    restored = session.park_restored_by_restart
    if restored is not None:
        # The session reconnected on its own, to a broker that had restored the park.
        session.park_restored_by_restart = None
        CellOutput().show(
            f"gpushare-restore-{uuid.uuid4().hex[:8]}",
            cell_lines.restored_by_restart_line(restored.describe()),
        )
    park = session.parked
    if park is not None:
        restore(session, park, CellOutput())


def after_cell(result: Any = None) -> None:
    """IPython's ``post_run_cell``: the cell ended (idle time counts from here)."""
    session = existing_session()
    if session is not None:
        session.cell_activity(running=False)


def install(ipython: Any) -> None:
    if not any(isinstance(t, RestoreBeforeCell) for t in ipython.ast_transformers):
        ipython.ast_transformers.append(RestoreBeforeCell())
    with contextlib.suppress(ValueError):
        ipython.events.unregister("post_run_cell", after_cell)
    ipython.events.register("post_run_cell", after_cell)


def uninstall(ipython: Any) -> None:
    ipython.ast_transformers[:] = [
        t for t in ipython.ast_transformers if not isinstance(t, RestoreBeforeCell)
    ]
    with contextlib.suppress(ValueError):
        ipython.events.unregister("post_run_cell", after_cell)
