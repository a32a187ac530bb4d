"""The ``%%gpu``, ``%gpu`` and ``%gpuconfig`` magics (thin: parsing and display only).

The lease lifecycle lives in :mod:`gpushare_ext.runtime.session`; this module turns
magic lines into :class:`LeaseOptions`, runs the cell body in the user's namespace
under the lease, and shows errors as one line.
"""

from __future__ import annotations

import ast
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class

from gpushare_ext.errors import GpushareError
from gpushare_ext.magics.arguments import KEYS, ArgumentError, parse_lease_arguments
from gpushare_ext.runtime import cell_lines
from gpushare_ext.runtime.ranks import RankFailed
from gpushare_ext.runtime.session import (
    CellOutput,
    GpuSession,
    current_session,
)


def _key_table(keys: dict[str, str]) -> str:
    """The keys as docstring rows: every row at the docstring's own indentation (the
    first takes the placeholder's), so the columns line up in ``%%gpu?``."""
    return "\n        ".join(f"{key:<13} {text}" for key, text in keys.items())


_KEY_HELP = _key_table(KEYS)
# %gpuconfig sets defaults; ranks is a cell's own choice (it refuses it as a default).
_CONFIG_KEY_HELP = _key_table({k: v for k, v in KEYS.items() if k != "ranks"})


@magics_class
class GpuMagics(Magics):
    @line_cell_magic
    def gpu(self, line: str, cell: str | None = None):
        """Run a cell with a GPU lease from the gpushare broker, or manage this session.

        Cell magic::

            %%gpu priority=high mem=8GiB device=auto timeout=30s
            ... your GPU code ...

        Arguments (``key=value`` or ``--key value``; unset ones come from ``%gpuconfig``):

        {keys}

        While the GPU is busy the cell shows a live line
        ``queued: position N, waiting for <user> (priority ...)``; interrupt the kernel to
        withdraw.  A lower-priority cell of another user is paused while yours runs; your
        cell may itself be paused for a higher-priority one ("paused for a
        higher-priority session").  The lease is released when the cell ends, also on
        errors and interrupts.

        With ``ranks=N`` the cell runs in N worker processes instead of this kernel, each
        on its own slice of one gang lease, with ``torch.distributed`` initialised among
        them (``RANK``, ``WORLD_SIZE`` set; NCCL between whole GPUs, gloo otherwise).  The
        cell's code is all a worker has: names defined in other cells are not there.
        Each rank's output shows prefixed ``[rank N]``; interrupting stops every rank.

        Line magic::

            %gpu status     live occupancy view (widget, or a text table)
            %gpu release    release every lease this kernel holds
        """
        __tracebackhide__ = True
        if cell is None:
            return self._gpu_line(line)
        try:
            options = parse_lease_arguments(line)
        except ArgumentError as exc:
            raise UsageError(f"%%gpu: {exc}") from None
        session = current_session()
        label = next((text.strip() for text in cell.splitlines() if text.strip()), "")[:120]
        output = CellOutput()
        ranks = options.pop("ranks", 1)
        if ranks > 1:
            return self._run_ranks(session, cell, ranks, output, label, options)
        raised_by_cell: list[BaseException] = []
        try:
            with session.lease(output=output, label=label, **options):
                try:
                    return self._run_body(cell)
                except BaseException as exc:  # the cell's own errors are the user's to see
                    raised_by_cell.append(exc)
                    raise
        except GpushareError as exc:
            if raised_by_cell and exc is raised_by_cell[0]:
                raise
            raise UsageError(exc.in_cell()) from None
        except KeyboardInterrupt:
            if raised_by_cell:
                raise
            # Interrupted while queued (the cell's line says the request was withdrawn):
            # a bare KeyboardInterrupt, not a trace through the queue's waits.
            raise KeyboardInterrupt from None

    gpu.__doc__ = (gpu.__doc__ or "").replace("{keys}", _KEY_HELP)

    def _run_ranks(
        self,
        session: GpuSession,
        cell: str,
        ranks: int,
        output: CellOutput,
        label: str,
        options: dict,
    ) -> None:
        """The cell, in ``ranks`` worker processes under one gang lease."""
        __tracebackhide__ = True
        source = self.shell.transform_cell(cell)
        try:
            session.run_gang(source, ranks=ranks, output=output, label=label, lease_options=options)
        except RankFailed as exc:
            if exc.remote_traceback:
                print(exc.remote_traceback, file=sys.stderr)
            raise UsageError(exc.in_cell()) from None
        except GpushareError as exc:
            raise UsageError(exc.in_cell()) from None

    def _run_body(self, cell: str):
        __tracebackhide__ = True
        shell = self.shell
        source = shell.transform_cell(cell)
        tree = ast.parse(source)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        namespace = shell.user_ns
        # Under a name whose source IPython keeps (as for any cell), so a traceback from
        # the cell shows its lines, not "Could not get source".
        filename = shell.compile.cache(source)
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            return eval(compile(last, filename, "eval"), namespace)
        return None

    def _gpu_line(self, line: str):
        command = line.strip().split()
        if not command or command[0] in ("status", "st"):
            return self._status()
        if command[0] == "release":
            print(cell_lines.released_line(current_session().release_all()))
            return None
        raise UsageError(f"%gpu: unknown command {command[0]!r}; use %gpu status or %gpu release")

    def _status(self):
        session = current_session()
        try:
            from gpushare_ext.widgets import widget

            return widget(str(session.connect().socket_path))
        except ImportError:
            pass
        except GpushareError as exc:
            raise UsageError(exc.in_cell()) from None
        from gpushare_ext.status_view import status_text

        try:
            snapshot = session.connect().status()
        except GpushareError as exc:
            raise UsageError(exc.in_cell()) from None
        print(status_text(snapshot))
        return None

    @line_magic
    def gpuconfig(self, line: str):
        """Set this kernel's defaults for ``%%gpu`` cells, or show them with no arguments.

        Example: ``%gpuconfig priority=low mem=40GiB timeout=none``.  Keys:

        {keys}
        """
        session = current_session()
        if line.strip():
            try:
                options = parse_lease_arguments(line)
            except ArgumentError as exc:
                raise UsageError(f"%gpuconfig: {exc}") from None
            if "ranks" in options:
                raise UsageError(
                    "%gpuconfig: ranks is a cell's own choice, not a default; "
                    "use %%gpu ranks=N on the cell"
                )
            session.defaults = session.merged(**options)
        d = session.defaults
        print(
            cell_lines.defaults_line(
                priority=d.priority,
                memory_bytes=d.memory_bytes,
                device=d.device,
                timeout_s=d.timeout_s,
                slice_wish=d.slice.value,
                sm_share=d.sm_share,
            )
        )

    gpuconfig.__doc__ = (gpuconfig.__doc__ or "").replace("{keys}", _CONFIG_KEY_HELP)
