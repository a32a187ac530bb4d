"""Saving a stopped thread's state: what to save, and the PTX that saves and reloads it.

What it is for: :func:`plan_save` decides whether an abort variant can save its
threads' state (no shared or local memory, no barriers, no warp collectives, no calls)
and which registers are live at each back-edge check (``liveness.py``); the stubs store
them in the thread's cells of the save area, reload them in the next slice's prologue,
and branch back to the loop's header.

What it must not do: add the checks themselves (``back_edges.py``) or the persistent
loop (``persistent.py``), launch, or touch CUDA.
"""

from __future__ import annotations

import re
from typing import Any

from gpushare_ext.kernels.callees import call_refusal, call_target, callees
from gpushare_ext.kernels.ptx import Instruction
from gpushare_ext.kernels.rewrite import (
    BLOCK_COORDS,
    MAX_SAVED_REGISTERS,
    SavePlan,
    TransformState,
    needs_block_sync,
)

__all__ = ["plan_save", "restore_stub", "resume_saved", "save_stub"]

# ---------------------------------------------------------------------------------------
# Saving a stopped thread's state (abort mode)
# ---------------------------------------------------------------------------------------

#: PTX register type -> the bit-size type a save or reload moves it with.
_SAVE_WIDTH = {
    **dict.fromkeys(("b16", "u16", "s16", "f16", "bf16"), "b16"),
    **dict.fromkeys(("b32", "u32", "s32", "f32", "f16x2", "bf16x2"), "b32"),
    **dict.fromkeys(("b64", "u64", "s64", "f64"), "b64"),
    "pred": "pred",
}
#: Instructions whose result depends on the other threads of the warp being at the same
#: point: a parked neighbour would change it.
_WARP_COLLECTIVES = (
    "shfl", "vote", "match", "redux", "activemask", "elect", "mma", "wmma", "wgmma",
    "ldmatrix", "stmatrix", "movmatrix", "tcgen05", "bar", "barrier", "mbarrier",
)  # fmt: skip


def _save_refusal(state: TransformState, checks: dict[int, str]) -> str | None:
    """Why this kernel's threads cannot stop and go on from saved registers, or None.

    A thread's whole state must be its registers: no shared or local memory, no
    barriers (threads of a block stop at different points), no warp collectives, and
    calls only into functions the analysis steps over (``callees.py``: their frames
    are gone by the time a back-edge check runs) that use no warp collective either."""
    if any(kind == "uniform" for kind in checks.values()):
        return "a loop has barriers"
    if needs_block_sync(state):
        return "it uses shared memory or barriers"
    for s in state.entry.body:
        if s.kind == "decl" and s.text.lstrip().startswith(".local"):
            return "it uses local memory"
    for ins in state.entry.instructions:
        if ins.base == "call":
            why = _call_refusal(state, ins)
            if why:
                return why
        if ins.base in _WARP_COLLECTIVES:
            return f"it uses the warp collective {ins.opcode}"
        if ins.state_space == "local" or any("%SP" in o for o in ins.operands):
            return "it uses local memory"
    return None


def _call_refusal(state: TransformState, ins: Instruction) -> str | None:
    """Why a thread that calls here cannot save its state, or None."""
    callee = call_target(ins)
    called = next((f for f in state.module.functions if f.name == callee), None)
    if called is None or call_refusal(state.module, ins) is not None:
        return "it calls a function"  # printf, or one the analysis cannot step over
    for fn in (called, *callees(state.module, called)):
        used = next((x for x in fn.instructions if x.base in _WARP_COLLECTIVES), None)
        if used is not None:
            return f"it calls {fn.name}, which uses the warp collective {used.opcode}"
    return None


def _back_edge(state: TransformState, at: int, header: int) -> tuple[str, str] | str:
    """(header label, the condition of going back to it) for the check at ``at``, or why
    the loop's shape is not one a saved thread can go on in."""
    cfg = state.report.cfg
    instrs = state.entry.instructions
    labels = [lab for lab, b in cfg.labels.items() if b == header]
    if not labels:
        return "a loop header has no label"
    if at < len(instrs) and instrs[at].base in ("bra", "brx"):
        branch = instrs[at]
        if branch.base == "brx" or not branch.operands or branch.operands[0] not in labels:
            return "a loop goes back through an indirect or fall-through edge"
        return branch.operands[0], branch.guard or ""
    return labels[0], ""  # the latch falls through into the header


def plan_save(
    state: TransformState, checks: dict[int, str], headers: dict[int, int]
) -> SavePlan | str:
    """The registers each check saves, or the reason (a short phrase) it cannot."""
    from gpushare_ext.kernels.liveness import (
        live_before,
        recomputable_registers,
        register_file,
    )

    refusal = _save_refusal(state, checks)
    if refusal:
        return refusal
    regs = register_file(state.entry)
    cfg = state.report.cfg
    points = sorted(checks)
    shapes = {at: _back_edge(state, at, headers[at]) for at in points}
    for shape in shapes.values():
        if isinstance(shape, str):
            return shape
    starts = {at: cfg.blocks[headers[at]][0] for at in points}
    instrs = state.entry.instructions
    live = live_before(instrs, cfg, regs, set(starts.values()))
    again = recomputable_registers(state.entry, regs)
    text_of = {it.orig: it.render().strip() for it in state.body if it.stmt.instr is not None}
    union: list[str] = []
    per_check: dict[int, tuple[str, ...]] = {}
    resume_at: dict[int, str] = {}
    park_if: dict[int, str] = {}
    recompute: dict[int, tuple[str, ...]] = {}
    for n, at in enumerate(points):
        order = _recompute_order(live[starts[at]], again, instrs, regs)
        recompute[n] = tuple(text_of[i] for i in order)
        names = sorted(live[starts[at]] - set(again), key=_register_order)
        for r in names:
            if r not in regs.types:
                return f"register {r} is declared in a nested scope"
            if regs.types[r] not in _SAVE_WIDTH:
                return f"register {r} has type .{regs.types[r]}"
            if r not in union:
                union.append(r)
        per_check[n] = tuple(names)
        resume_at[n], park_if[n] = shapes[at]  # type: ignore[misc]
    if len(union) > MAX_SAVED_REGISTERS:
        return f"{len(union)} live registers (at most {MAX_SAVED_REGISTERS} are saved)"
    union.sort(key=_register_order)
    types = {r: _SAVE_WIDTH[regs.types[r]] for r in union}
    return SavePlan(tuple(union), per_check, types, resume_at, park_if, recompute)


def _recompute_order(
    live: frozenset[str], again: dict[str, int], instrs: list[Instruction], regs: Any
) -> list[int]:
    """The definitions to run again for the live recomputable registers, with what they
    read, in program order."""
    from gpushare_ext.kernels.liveness import uses_and_defs

    wanted: set[int] = set()
    work = [r for r in live if r in again]
    while work:
        r = work.pop()
        i = again[r]
        if i in wanted:
            continue
        wanted.add(i)
        uses, _ = uses_and_defs(instrs[i], regs)
        work += [u for u in uses if u in again]
    return sorted(wanted)


def _register_order(name: str) -> tuple[str, int]:
    m = re.match(r"^(%[A-Za-z_$]+?)(\d*)$", name)
    if m is None:  # pragma: no cover - _registers_named only yields such names
        return (name, 0)
    return (m.group(1), int(m.group(2) or 0))


def _cell_address(plan: SavePlan, register: str) -> str:
    return f"mad.lo.s64 %gs_sp, %gs_sst, {plan.cell(register)}, %gs_sv;"


def _thread_cells() -> list[str]:
    """``%gs_sv``: this thread's first cell (row ``ctaid.x * threads + thread``);
    ``%gs_sst``: the bytes between two cells of a thread. Computed where needed, from the
    parameters and special registers, rather than kept: two 64-bit values live across
    the whole kernel would cost every variant registers (occupancy) for a cold path."""
    return [
        "ld.param.u64 %gs_sv0, [__gs_save];",
        "cvta.to.global.u64 %gs_sv, %gs_sv0;",
        "ld.param.u64 %gs_sst, [__gs_savestride];",
        "mov.u32 %gs_t, %tid.z;",
        "mov.u32 %gs_t2, %ntid.y;",
        "mov.u32 %gs_g, %tid.y;",
        "mad.lo.u32 %gs_t, %gs_t, %gs_t2, %gs_g;",
        "mov.u32 %gs_t2, %ntid.x;",
        "mov.u32 %gs_g, %tid.x;",
        "mad.lo.u32 %gs_g, %gs_t, %gs_t2, %gs_g;",
        "mov.u32 %gs_t, %ntid.y;",
        "mul.lo.u32 %gs_t2, %gs_t2, %gs_t;",
        "mov.u32 %gs_t, %ntid.z;",
        "mul.lo.u32 %gs_t2, %gs_t2, %gs_t;",
        "mov.u32 %gs_t, %ctaid.x;",
        "mad.lo.u32 %gs_g, %gs_t, %gs_t2, %gs_g;",
        "mul.wide.u32 %gs_sp, %gs_g, 8;",
        "add.s64 %gs_sv, %gs_sv, %gs_sp;",
    ]


def save_stub(plan: SavePlan, n: int) -> list[str]:
    """Check ``n``'s save: tag, position in the chunk, then its live registers."""
    out = [
        f"$__gs_save{n}:",
        *_thread_cells(),
        f"mov.u32 %gs_t, {n + 1};",
        "st.global.u32 [%gs_sv], %gs_t;",
        "add.s64 %gs_sp, %gs_sv, %gs_sst;",
        "st.global.u32 [%gs_sp], %gs_id;",
        "add.s64 %gs_sp, %gs_sp, %gs_sst;",
        "st.global.u32 [%gs_sp], %gs_lim;",
        "add.s64 %gs_sp, %gs_sp, %gs_sst;",
        "st.global.u32 [%gs_sp], %gs_base;",
    ]
    for r in plan.live[n]:
        out.append(_cell_address(plan, r))
        width = plan.types[r]
        if width == "pred":
            out += [f"selp.u32 %gs_t, 1, 0, {r};", "st.global.u32 [%gs_sp], %gs_t;"]
        else:
            out.append(f"st.global.{width} [%gs_sp], {r};")
    out.append("bra $__gs_park;")
    return out


def restore_stub(plan: SavePlan, n: int) -> list[str]:
    """Reload check ``n``'s registers and go on at its loop's header."""
    out = [f"$__gs_restore{n}:", *plan.recompute.get(n, ())]
    for r in plan.live[n]:
        out.append(_cell_address(plan, r))
        width = plan.types[r]
        if width == "pred":
            out += ["ld.global.u32 %gs_t, [%gs_sp];", f"setp.ne.u32 {r}, %gs_t, 0;"]
        else:
            out.append(f"ld.global.{width} {r}, [%gs_sp];")
    out.append(f"bra {plan.resume_at[n]};")
    return out


def resume_saved(plan: SavePlan) -> list[str]:
    """Prologue of a state-saving variant: find this thread's cell, and if an earlier
    slice left it stopped mid-chunk, reload the chunk position and go on where it was."""
    out = [
        "// gpushare: a thread stopped by an earlier slice goes on where it was",
        *_thread_cells(),
        # The block's "a thread parked" mark and its parked threads' minimums (first
        # sight of the flag, logical block), reset before anyone can park.
        "mov.u32 %gs_t, 0;",
        "@%gs_leader st.shared.u32 [__gs_stopped], %gs_t;",
        "mov.u64 %gs_sp, 0xFFFFFFFFFFFFFFFF;",
        "@%gs_leader st.shared.u64 [__gs_firstseen], %gs_sp;",
        "mov.u32 %gs_t, 0xFFFFFFFF;",
        "@%gs_leader st.shared.u32 [__gs_lowstop], %gs_t;",
        "barrier.sync 0;",
        "ld.global.u32 %gs_tag, [%gs_sv];",
        "setp.eq.u32 %gs_pr, %gs_tag, 0;",
        "@%gs_pr bra $__gs_next;",
        "mov.u32 %gs_t, 0;",
        "st.global.u32 [%gs_sv], %gs_t;",
        "add.s64 %gs_sp, %gs_sv, %gs_sst;",
        "ld.global.u32 %gs_id, [%gs_sp];",
        "add.s64 %gs_sp, %gs_sp, %gs_sst;",
        "ld.global.u32 %gs_lim, [%gs_sp];",
        "add.s64 %gs_sp, %gs_sp, %gs_sst;",
        "ld.global.u32 %gs_base, [%gs_sp];",
        *BLOCK_COORDS,
    ]
    for n in sorted(plan.live):
        out += [f"setp.eq.u32 %gs_pr, %gs_tag, {n + 1};", f"@%gs_pr bra $__gs_restore{n};"]
    out.append("bra $__gs_next;")
    return out
