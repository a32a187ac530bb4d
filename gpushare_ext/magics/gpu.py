"""The ``%%gpu``, ``%gpu`` and ``%gpuconfig`` magics (thin: parsing and display only).

The lease lifecycle lives in :mod:`gpushare_ext.runtime.session`; this module turns
magic lines into :class:`LeaseOptions`, runs the cell body in the user's namespace
under the lease, and shows errors as one line.

An error in the cell's own code reads as it would without ``%%gpu``: ``Cell In[7],
line 3`` (the cell's number, and its lines counted from the ``%%gpu`` line), with no
frame of IPython's ``run_cell_magic`` or of this module.  gpushare's own errors, and an
interrupt before the cell's code started, are one line.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType, TracebackType
from typing import Any

from IPython import get_ipython
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


@dataclass(frozen=True)
class CellBody:
    """A ``%%gpu`` cell's code, compiled under the cell's own name (``Cell In[N]``) with
    its lines numbered as the user sees them: the ``%%gpu`` line is line 1."""

    statements: CodeType
    last_expression: CodeType | None  # shown as the cell's result, as IPython does


def cell_number(shell: Any, frame: FrameType | None) -> int:
    """The ``In[N]`` of the cell running this magic: that of the nearest caller whose
    code IPython compiled as a cell (IPython's own counter has moved on by then in some
    versions, and not in others)."""
    numbers = getattr(shell.compile, "_filename_map", {})
    while frame is not None:
        number = numbers.get(frame.f_code.co_filename)
        if number is not None:
            return number
        frame = frame.f_back
    return shell.execution_count


def compile_body(shell: Any, magic_line: str, cell: str, number: int) -> CellBody:
    """The cell's code compiled as ``In[number]``; a SyntaxError names that cell and
    the line as the user sees it."""
    source = shell.transform_cell(cell)
    first_line = f"%%gpu {magic_line}".rstrip()
    # IPython keeps the source under this name, so a traceback shows the cell's lines.
    filename = shell.compile.cache(
        f"{first_line}\n{source}", number, raw_code=f"{first_line}\n{cell}"
    )
    # A blank first line stands for the %%gpu line: every line keeps its number.
    tree = ast.parse("\n" + source, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    return CellBody(
        statements=compile(tree, filename, "exec"),
        last_expression=compile(last, filename, "eval") if last is not None else None,
    )


# As IPython reads a cell magic's first line: its name, then after one space its line.
_GPU_CELL = re.compile(r"%%gpu(?: (?P<line>.*))?\n?$")


def syntax_errors_as_the_cells(lines: list[str]) -> list[str]:
    """An input transformer (IPython's cleanup stage, installed at load): a ``%%gpu``
    cell whose code does not compile raises its SyntaxError here, before the cell runs
    and before a lease is asked for, so IPython shows it as for any cell (``Cell In[N],
    line L`` and the caret) and not from inside the magic, with its frames.  Every
    other cell passes unchanged."""
    match = _GPU_CELL.match(lines[0]) if lines else None
    shell = get_ipython() if match is not None else None
    if match is None or shell is None:
        return lines
    # At this stage IPython's counter is still the number this cell will show.
    magic_line = (match["line"] or "").rstrip()
    compile_body(shell, magic_line, "".join(lines[1:]), shell.execution_count)
    return lines


# Not while IPython asks whether typed lines are complete: only when a cell runs.
syntax_errors_as_the_cells.has_side_effects = True  # type: ignore[attr-defined]


def shown_as(error: BaseException, render: Callable[[], list[str]]) -> BaseException:
    """``error``, shown by IPython as ``render()`` says (its ``_render_traceback_``
    hook) instead of a traceback through this module; its type stays what it is."""
    error._render_traceback_ = render  # type: ignore[attr-defined]
    return error


def _from_the_cell(shell: Any, error: BaseException, cell_frames: TracebackType) -> None:
    """Make IPython show ``error`` from the cell's own frames on, as a plain cell would."""

    def render() -> list[str]:
        return shell.InteractiveTB.structured_traceback(
            type(error), error, cell_frames, tb_offset=0
        )

    shown_as(error, render)


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
        body = self._compile(line, cell)
        raised_by_cell: list[BaseException] = []
        try:
            with session.lease(output=output, label=label, **options):
                try:
                    return self._run_body(body)
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
            # Interrupted before the cell's code ran (queued, or waiting for the broker:
            # the cell's line above says which): one line, no trace through the waits.
            words = f"KeyboardInterrupt: {cell_lines.INTERRUPTED_BEFORE_RUN}"
            interrupted = KeyboardInterrupt(cell_lines.INTERRUPTED_BEFORE_RUN)
            raise shown_as(interrupted, lambda: [words]) from None

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

    def _compile(self, line: str, cell: str) -> CellBody:
        """The cell's code, compiled before a lease is asked for.  (A syntax error in a
        cell typed as such never gets here: :func:`syntax_errors_as_the_cells` raised it
        before the cell ran.)"""
        __tracebackhide__ = True
        shell = self.shell
        return compile_body(shell, line, cell, cell_number(shell, sys._getframe(1)))

    def _run_body(self, body: CellBody) -> Any:
        __tracebackhide__ = True
        namespace = self.shell.user_ns
        try:
            exec(body.statements, namespace)
            if body.last_expression is not None:
                return eval(body.last_expression, namespace)
        except BaseException as exc:
            here = exc.__traceback__
            if here is not None and here.tb_next is not None:
                _from_the_cell(self.shell, exc, here.tb_next)  # the cell's own frames on
            raise
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
