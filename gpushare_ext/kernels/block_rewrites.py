"""The rewrites of one logical block's body: block ids, returns, address fences.

What it is for: the passes that make a kernel's body runnable as one logical block of a
persistent block: refusing what cannot be rewritten (:class:`CheckSupported`),
``%ctaid``/``%nctaid`` read from the logical id (:class:`RewriteBlockIds`), ``ret`` as
a branch to the logical block's end (:class:`RewriteReturns`), and global accesses
clamped to the buffers passed (:class:`FenceGlobalAccesses`).

What it must not do: add the persistent loop or flag checks (``persistent.py``,
``back_edges.py``), launch, or touch CUDA.
"""

from __future__ import annotations

import re

from gpushare_ext.kernels.ptx import Instruction, KernelError, Param, Statement
from gpushare_ext.kernels.rewrite import Item, Pass, RecordLayout, TransformState

__all__ = ["CheckSupported", "FenceGlobalAccesses", "RewriteBlockIds", "RewriteReturns"]

_SPECIAL = re.compile(r"%(n?ctaid)\.([xyz])\b")
_CTAID_REG = {"x": "%gs_cx", "y": "%gs_cy", "z": "%gs_cz"}
_NCTAID_REG = {"x": "%gs_nx", "y": "%gs_ny", "z": "%gs_nz"}


def _replace_instr(item: Item, ins: Instruction) -> Item:
    return Item(
        Statement("instr", ins.text()[:-1], item.stmt.line, instr=ins, depth=item.stmt.depth),
        item.orig,
    )


class CheckSupported(Pass):
    """Refuses kernels the persistent scheme cannot keep correct, with the reason."""

    name = "check-supported"
    effect = "analysis"

    def run(self, state: TransformState) -> None:
        r = state.report
        if r.grid_sync:
            raise KernelError(
                "not-resumable",
                f"kernel {r.name} synchronises across blocks ({r.grid_sync[0]}); persistent "
                "blocks would deadlock. Run it uninstrumented under the process lock instead.",
            )
        if r.unsupported:
            raise KernelError("unsupported", f"kernel {r.name}: {r.unsupported[0]}")
        if r.early_exit_hazards:
            raise KernelError(
                "early-exit-before-barrier",
                f"kernel {r.name}: {r.early_exit_hazards[0]}; returned threads would wait at the "
                "next logical block instead of leaving the barrier. Guard the work with an "
                "if instead of returning early.",
            )
        if state.entry.kind != "entry":
            raise KernelError("not-a-kernel", f"{r.name} is a device function, not a kernel")


class RewriteBlockIds(Pass):
    """``%ctaid.*`` -> logical block coordinates; ``%nctaid.*`` -> original grid dims."""

    name = "rewrite-block-ids"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        out = []
        for item in state.body:
            ins = item.stmt.instr
            if ins is not None and any(_SPECIAL.search(o) for o in ins.operands):
                ops = tuple(
                    _SPECIAL.sub(
                        lambda m: (_NCTAID_REG if m.group(1) == "nctaid" else _CTAID_REG)[
                            m.group(2)
                        ],
                        o,
                    )
                    for o in ins.operands
                )
                item = _replace_instr(
                    item, Instruction(ins.opcode, ops, ins.guard, ins.line, ins.src_line)
                )
            out.append(item)
        state.body = out


class RewriteReturns(Pass):
    """``ret``/``exit`` -> branch to the end of the logical block (guard kept)."""

    name = "rewrite-returns"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        out = []
        for item in state.body:
            ins = item.stmt.instr
            if ins is not None and ins.base in ("ret", "exit"):
                item = _replace_instr(
                    item, Instruction("bra", ("$__gs_done",), ins.guard, ins.line, ins.src_line)
                )
            out.append(item)
        state.body = out


def _declare_fenced_buffers(state: TransformState, fenced: list[str]) -> None:
    """A base and a size parameter per fenced buffer, read once in the prologue, and the
    registers every fence shares."""
    for k in range(len(fenced)):
        state.extra_params += [
            Param(f"__gs_fbase{k}", "u64", 8, 8),
            Param(f"__gs_fsize{k}", "u64", 8, 8),
        ]
        state.decls.append(f".reg .b64 %gs_fb{k}, %gs_fg{k}, %gs_fs{k};")
        state.prologue += [
            f"ld.param.u64 %gs_fb{k}, [__gs_fbase{k}];",
            f"cvta.to.global.u64 %gs_fg{k}, %gs_fb{k};",
            f"ld.param.u64 %gs_fs{k}, [__gs_fsize{k}];",
        ]
    state.decls.append(".reg .b64 %gs_fa, %gs_fo, %gs_fe;")
    state.decls.append(".reg .pred %gs_fok, %gs_fq, %gs_fbad, %gs_fgd;")


def _address_into_register(addr: str) -> str:
    """``%gs_fa`` set to the access's address, ``reg+offset`` or a plain operand."""
    m = re.match(r"^(.+?)\s*\+\s*(-?\w+)$", addr)
    if m:
        return f"add.s64 %gs_fa, {m.group(1).strip()}, {m.group(2)};"
    return f"mov.b64 %gs_fa, {addr};"


def _in_range_checks(
    candidates: list[str], fenced: list[str], is_global: bool, width: int
) -> list[str]:
    """``%gs_fok`` set when all ``width`` bytes at ``%gs_fa`` lie inside one of the
    candidate buffers (never, when there is none)."""
    if not candidates:
        return ["setp.ne.u32 %gs_fok, %gs_nx, %gs_nx;"]  # nothing declared: never in range
    seq: list[str] = []
    for j, p in enumerate(candidates):
        k = fenced.index(p)
        base = f"%gs_fg{k}" if is_global else f"%gs_fb{k}"
        target = "%gs_fok" if j == 0 else "%gs_fq"
        seq += [
            f"sub.s64 %gs_fo, %gs_fa, {base};",
            f"add.s64 %gs_fe, %gs_fo, {width - 1};",
            f"setp.lt.u64 {target}, %gs_fo, %gs_fs{k};",
            f"setp.lt.and.u64 {target}, %gs_fe, %gs_fs{k}, {target};",
        ]
        if j:
            seq.append("or.pred %gs_fok, %gs_fok, %gs_fq;")
    return seq


def _count_if_it_would_run(guard: str | None) -> list[str]:
    """``%gs_fbad`` (out of range) narrowed to the threads the guard lets run, then
    counted in the progress record."""
    seq: list[str] = []
    if guard:
        if guard.startswith("!"):
            seq.append(f"not.pred %gs_fgd, {guard[1:]};")
            seq.append("and.pred %gs_fbad, %gs_fbad, %gs_fgd;")
        else:
            seq.append(f"and.pred %gs_fbad, %gs_fbad, {guard};")
    seq.append(f"@%gs_fbad red.global.add.u64 [%gs_prog+{RecordLayout.FENCED}], 1;")
    return seq


def _fenced_access(
    item: Item, ins: Instruction, candidates: list[str], fenced: list[str]
) -> list[Item]:
    """The fence before one access, then the access through the clamped address."""
    addr_op = next(o for o in ins.operands if o.startswith("["))
    addr = addr_op[1:-1].strip()
    is_global = ins.state_space == "global"
    seq = [f"// gpushare fence: {ins.opcode} at PTX line {ins.line}"]
    seq.append(_address_into_register(addr))
    seq += _in_range_checks(candidates, fenced, is_global, ins.access_width)
    scratch = "%gs_scratch_g" if is_global else "%gs_scratch"
    seq.append(f"selp.b64 %gs_fa, %gs_fa, {scratch}, %gs_fok;")
    seq.append("not.pred %gs_fbad, %gs_fok;")
    seq += _count_if_it_would_run(ins.guard)
    ops = tuple("[%gs_fa]" if o == addr_op else o for o in ins.operands)
    clamped = _replace_instr(item, Instruction(ins.opcode, ops, ins.guard, ins.line, ins.src_line))
    return [*(Item.raw(s) for s in seq), clamped]


class FenceGlobalAccesses(Pass):
    """Clamp each global load/store/atomic to the declared buffers (Guardian-style)."""

    name = "fence-global-accesses"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        report = state.report
        fenced = list(report.buffers)
        state.fenced = fenced
        _declare_fenced_buffers(state, fenced)
        by_index = {a.index: a for a in report.accesses}
        out: list[Item] = []
        count = 0
        for item in state.body:
            acc = by_index.get(item.orig) if item.orig is not None else None
            ins = item.stmt.instr
            # Module-scope variables are not passed buffers: nothing to clamp them to.
            if acc is None or ins is None or acc.origin.startswith("module-var:"):
                out.append(item)
                continue
            candidates = list(acc.params) if acc.params else list(fenced)
            out += _fenced_access(item, ins, candidates, fenced)
            count += 1
        state.body = out
        state.notes.append(f"fenced {count} global accesses over {len(fenced)} buffers")
