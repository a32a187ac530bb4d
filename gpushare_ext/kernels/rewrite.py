"""The machinery of the PTX rewrite, and the layout the rewritten kernel shares.

What it is for: the working state the passes rewrite (:class:`TransformState`, one
:class:`Item` per line of the body), what a pass is (:class:`Pass`) and how a named
pipeline runs them so that a failure names the pass (:class:`Pipeline`); the options
that choose a variant (:class:`TransformOptions`); the plan of a state-saving abort
(:class:`SavePlan`); and the progress record's layout (:class:`RecordLayout`), which the
launcher reads back.  See ``transform.py`` for the scheme.

What it must not do: rewrite anything itself (the passes do), launch, or touch CUDA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare_ext.kernels.ptx import Entry, KernelError, Param, PtxModule, Statement
from gpushare_ext.kernels.report import KernelReport

__all__ = [
    "BLOCK_COORDS",
    "MAX_SAVED_REGISTERS",
    "NO_BLOCK",
    "PROGRESS_RECORD_BYTES",
    "SAVE_HEADER_CELLS",
    "Item",
    "Pass",
    "Pipeline",
    "RecordLayout",
    "SavePlan",
    "TransformOptions",
    "TransformState",
    "needs_block_sync",
]

PROGRESS_RECORD_BYTES = 128
NO_BLOCK = 0xFFFFFFFF
#: Cells before the registers in a thread's save area: resume-point tag, logical block,
#: chunk end, chunk base.
SAVE_HEADER_CELLS = 4
#: More live registers than this at a back-edge and the variant aborts without saving
#: (the save area and its traffic grow with every register of every resident thread).
MAX_SAVED_REGISTERS = 96


class RecordLayout:
    """Byte offsets in the progress record (see the module docstring)."""

    NEXT_BLOCK = 0
    FINISHED = 4
    FIRST_YIELD_NS = 8
    LAST_EXIT_NS = 16
    FENCED = 24
    ABORTED = 32
    YIELD_EXITS = 36
    START_NS = 40
    END_NS = 48
    LOWEST_ABORTED = 56  # u32: the lowest logical block an aborting thread was in
    SCRATCH = 64


@dataclass(frozen=True)
class TransformOptions:
    """Which variant to build. ``abort_checks``: flag checks at loop back-edges;
    ``fence``: clamp global accesses to the declared buffers; ``save_state``: with abort
    checks, a thread that stops saves its live registers and goes on from them in the
    next slice, where the kernel allows it (see :class:`SavePlan`)."""

    abort_checks: bool = False
    fence: bool = False
    save_state: bool = True

    @property
    def key(self) -> str:
        mode = "yield"
        if self.abort_checks:
            mode = "abort+save" if self.save_state else "abort"
        return f"{mode}{'+fence' if self.fence else ''}"


@dataclass
class Item:
    """One line of the body being rewritten; ``orig`` is the analysed instruction index."""

    stmt: Statement
    orig: int | None = None

    @staticmethod
    def raw(text: str) -> Item:
        if text.endswith(":"):
            return Item(Statement("label", text[:-1], 0))
        return Item(Statement("raw", text, 0))

    def render(self) -> str:
        if self.stmt.kind == "raw":
            return "\t" + self.stmt.text
        return self.stmt.render()


@dataclass
class TransformState:
    module: PtxModule
    entry: Entry
    report: KernelReport
    options: TransformOptions
    body: list[Item]
    decls: list[str] = field(default_factory=list)  # our declarations
    extra_params: list[Param] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)
    prologue: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text: str = ""
    chunk_sync: bool = True  # a barrier between the logical blocks of a chunk
    save: SavePlan | None = None
    save_refusal: str = ""
    unrolled: dict[int, int] = field(default_factory=dict)  # back branch -> copies per round


class Pass:
    """A pipeline step: ``name``, ``effect`` (``analysis`` or ``rewrite``), ``run``."""

    name = "pass"
    effect = "analysis"

    def run(self, state: TransformState) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class Pipeline:
    name: str
    passes: tuple[Pass, ...]

    def run(self, state: TransformState) -> list[str]:
        done = []
        for p in self.passes:
            try:
                p.run(state)
            except KernelError as exc:
                raise KernelError(
                    exc.code, exc.message, step=f"{self.name}:{p.name}", log=exc.log
                ) from exc
            except Exception as exc:
                raise KernelError(
                    "internal", f"{type(exc).__name__}: {exc}", step=f"{self.name}:{p.name}"
                ) from exc
            done.append(p.name)
        return done


@dataclass(frozen=True)
class SavePlan:
    """What each per-thread check saves. ``registers``: every register some check saves,
    in cell order (cell ``SAVE_HEADER_CELLS + k`` holds ``registers[k]``); ``live``:
    check number -> the registers live at its loop's header; ``types``: register -> save
    width.

    A saved thread goes on at the loop header, the loop's one entry: going on in the
    middle of a loop would give it a second entry, and ptxas compiles such (irreducible)
    loops far worse."""

    registers: tuple[str, ...]
    live: dict[int, tuple[str, ...]]
    types: dict[str, str]
    #: check number -> the loop header label a saved thread goes on at, and the back
    #: edge's condition (see ``back_edges.abort_check``)
    resume_at: dict[int, str] = field(default_factory=dict)
    park_if: dict[int, str] = field(default_factory=dict)
    #: check number -> instructions a reload runs again instead of reading cells (the
    #: live registers :func:`~gpushare_ext.kernels.liveness.recomputable_registers` finds)
    recompute: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def cell(self, register: str) -> int:
        return SAVE_HEADER_CELLS + self.registers.index(register)


BLOCK_COORDS = (
    "rem.u32 %gs_cx, %gs_id, %gs_nx;",
    "div.u32 %gs_t, %gs_id, %gs_nx;",
    "rem.u32 %gs_cy, %gs_t, %gs_ny;",
    "div.u32 %gs_cz, %gs_id, %gs_nxy;",
)


def needs_block_sync(state: TransformState) -> bool:
    """Whether logical blocks run back to back in one persistent block need a barrier
    between them: the kernel has barriers, or touches shared memory (its own ``.shared``
    variables, dynamic shared memory, a module-scope ``.shared`` variable, a shared-window
    address). Kernels with neither have no state a next logical block could clobber."""
    if state.report.barriers:
        return True
    shared_vars = {n for n, sp in state.module.module_vars.items() if sp == "shared"}
    for item in state.body:
        st = item.stmt
        if st.kind == "decl" and ".shared" in st.text:
            return True
        ins = st.instr
        if ins is None:
            continue
        if "shared" in ins.opcode.split("."):
            return True
        for o in ins.operands:
            if any(re.search(rf"(?<![\w$.]){re.escape(v)}(?![\w$])", o) for v in shared_vars):
                return True
    return False
