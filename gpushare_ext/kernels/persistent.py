"""The persistent-block rewrite: the loop that claims chunks of logical blocks.

What it is for: :class:`PersistentBlocks` wraps the rewritten body in the persistent
loop (flag check, chunk claim, broadcast through shared memory, the logical blocks of
the chunk back to back, the exit stamps in the progress record), with the parking path
of a state-saving variant, and renders the entry's text.

What it must not do: rewrite the body itself (the earlier passes do), launch, or touch
CUDA.
"""

from __future__ import annotations

from gpushare_ext.kernels.ptx import Param, render_entry
from gpushare_ext.kernels.rewrite import (
    BLOCK_COORDS,
    NO_BLOCK,
    Item,
    Pass,
    RecordLayout,
    SavePlan,
    TransformState,
    needs_block_sync,
)
from gpushare_ext.kernels.saved_state import restore_stub, resume_saved, save_stub

__all__ = [
    "PersistentBlocks",
    "block_stop_marks",
    "groups_stop_together",
    "park_marks",
    "stop_marks",
]


# State-saving variants claim a chunk only once every thread of the block has finished
# the last one or parked (a barrier before the claim), and claim none once one parked:
# a parked thread owes the rest of its chunk, and must not miss its part of the next.
_PARKED_BLOCK_STOPS = ("barrier.sync 0;",)
_STOP_IF_PARKED = (
    "ld.shared.u32 %gs_t, [__gs_stopped];",
    "setp.ne.u32 %gs_pr, %gs_t, 0;",
    "@%gs_pr bra $__gs_blockstop;",
)


def _park(plan: SavePlan, grouped: bool) -> list[str]:
    """The save and reload stubs, the parking path and the block's stop: a thread that
    saved its state marks its block (in shared memory), then waits at the next dispatch
    like the others (it does not exit, so the block's barriers keep counting it); there
    the leader writes the block's marks in the record, once for the whole block."""
    out: list[str] = []
    for n in sorted(plan.live):
        out += save_stub(plan, n)
    for n in sorted(plan.live):
        out += restore_stub(plan, n)
    out += ["$__gs_park:", *park_marks(grouped), "bra $__gs_next;"]
    out += ["$__gs_blockstop:", *block_stop_marks(), "bra $__gs_publish;"]
    return out


def park_marks(grouped: bool = True) -> list[str]:
    """What a parking thread writes: in its block's shared slots, when it saw the flag
    and the logical block it stopped in (minimums over the block), and that the block
    has a parked thread.  Nothing global: :func:`block_stop_marks` writes the record
    once per block, after the barrier every parked thread waits at.  Why: with a word
    per warp group, a kernel filling an H200 still queued some eight thousand atomics
    on the same three words of the record, and the stop's drain stayed near 60 us."""
    lead = "@%gs_lead " if grouped else ""
    return [
        *(_lowest_active_lane() if grouped else ()),
        f"{lead}mov.u64 %gs_now, %globaltimer;",
        f"{lead}red.shared.min.u64 [__gs_firstseen], %gs_now;",
        f"{lead}red.shared.min.u32 [__gs_lowstop], %gs_id;",
        "mov.u32 %gs_t, 1;",
        "st.shared.u32 [__gs_stopped], %gs_t;",
    ]


def block_stop_marks() -> list[str]:
    """The leader, once every thread of its block has parked or finished its chunk
    (the dispatch's barrier): the block's first sight of the flag, now as its exit,
    the lowest logical block its threads stopped in, and that the slice was aborted."""
    L = RecordLayout
    return [
        "ld.shared.u64 %gs_now, [__gs_firstseen];",
        f"red.global.min.u64 [%gs_prog+{L.FIRST_YIELD_NS}], %gs_now;",
        "mov.u64 %gs_now, %globaltimer;",
        f"red.global.max.u64 [%gs_prog+{L.LAST_EXIT_NS}], %gs_now;",
        "ld.shared.u32 %gs_t, [__gs_lowstop];",
        f"red.global.min.u32 [%gs_prog+{L.LOWEST_ABORTED}], %gs_t;",
        "mov.u32 %gs_t, 1;",
        f"st.global.u32 [%gs_prog+{L.ABORTED}], %gs_t;",
    ]


_LOOP_PARAMS = (
    Param("__gs_progress", "u64", 8, 8),
    Param("__gs_yieldflag", "u64", 8, 8),
    Param("__gs_gridx", "u32", 4, 4),
    Param("__gs_gridy", "u32", 4, 4),
    Param("__gs_gridz", "u32", 4, 4),
    Param("__gs_stop", "u32", 4, 4),
    Param("__gs_chunk", "u32", 4, 4),
)
_SAVE_PARAMS = (
    Param("__gs_save", "u64", 8, 8),
    Param("__gs_savestride", "u64", 8, 8),
)
_LOOP_DECLS = (
    ".reg .b64 %gs_prog0, %gs_prog, %gs_flag0, %gs_flag, %gs_now, %gs_scratch, %gs_scratch_g;",
    ".reg .b32 %gs_nx, %gs_ny, %gs_nz, %gs_stop, %gs_nxy, %gs_t, %gs_t2, %gs_id, %gs_flagv;",
    ".reg .b32 %gs_cx, %gs_cy, %gs_cz, %gs_chunk, %gs_base, %gs_lim, %gs_sa, %gs_bc, %gs_bm;",
    ".reg .pred %gs_leader, %gs_pseen, %gs_pend, %gs_pa, %gs_pb, %gs_pmore, %gs_pf;",
    ".reg .b32 %gs_am, %gs_ln;",
    ".reg .pred %gs_lead;",
    # Two slots, used alternately by consecutive chunks: the leader can write the
    # next chunk's base while a slow warp still reads this one's (one barrier per
    # chunk instead of two).
    ".shared .align 8 .b32 __gs_slot[2];",
    ".shared .align 4 .b32 __gs_abortslot;",
)
_SAVE_DECLS = (
    ".reg .b64 %gs_sv0, %gs_sv, %gs_sst, %gs_sp;",
    ".reg .b32 %gs_g, %gs_tag;",
    ".reg .pred %gs_pr;",
    ".shared .align 4 .b32 __gs_stopped;",  # a thread of the block parked
    ".shared .align 8 .b64 __gs_firstseen;",  # the block's parked threads: first sight
    ".shared .align 4 .b32 __gs_lowstop;",  # and the lowest logical block stopped in
)


def _add_params_and_decls(state: TransformState, plan: SavePlan | None) -> None:
    """The loop's parameters go first (the save buffer's after them), its registers and
    shared slots before every earlier pass's."""
    state.extra_params[:0] = list(_LOOP_PARAMS)
    if plan is not None:
        state.extra_params[7:7] = list(_SAVE_PARAMS)
    state.decls[:0] = list(_LOOP_DECLS)
    if plan is not None:
        state.decls += list(_SAVE_DECLS)


def _prologue(state: TransformState, plan: SavePlan | None) -> list[str]:
    """Once per physical block: the loop's parameters read, the leader chosen, the start
    stamped, then the earlier passes' prologue and a saved state's reload."""
    L = RecordLayout
    return [
        "// gpushare: persistent preemptible blocks, chunks of logical blocks",
        "ld.param.u64 %gs_prog0, [__gs_progress];",
        "cvta.to.global.u64 %gs_prog, %gs_prog0;",
        "ld.param.u64 %gs_flag0, [__gs_yieldflag];",
        "cvta.to.global.u64 %gs_flag, %gs_flag0;",
        f"add.s64 %gs_scratch, %gs_prog0, {L.SCRATCH};",
        f"add.s64 %gs_scratch_g, %gs_prog, {L.SCRATCH};",
        "ld.param.u32 %gs_nx, [__gs_gridx];",
        "ld.param.u32 %gs_ny, [__gs_gridy];",
        "ld.param.u32 %gs_nz, [__gs_gridz];",
        "ld.param.u32 %gs_stop, [__gs_stop];",
        "ld.param.u32 %gs_chunk, [__gs_chunk];",
        "max.u32 %gs_chunk, %gs_chunk, 1;",
        "mov.u32 %gs_bc, 0;",  # iterations since the last per-thread flag check
        "mul.lo.u32 %gs_nxy, %gs_nx, %gs_ny;",
        "mov.u32 %gs_t, %tid.x;",
        "mov.u32 %gs_t2, %tid.y;",
        "or.b32 %gs_t, %gs_t, %gs_t2;",
        "mov.u32 %gs_t2, %tid.z;",
        "or.b32 %gs_t, %gs_t, %gs_t2;",
        "setp.eq.u32 %gs_leader, %gs_t, 0;",
        "mov.u32 %gs_sa, __gs_slot;",
        "@%gs_leader mov.u64 %gs_now, %globaltimer;",
        f"@%gs_leader red.global.min.u64 [%gs_prog+{L.START_NS}], %gs_now;",
        *state.prologue,
        *(resume_saved(plan) if plan is not None else ()),
    ]


def _dispatch(plan: SavePlan | None) -> list[str]:
    """The head of the loop: the leader checks the flag and claims a chunk, every thread
    reads the claim back, and the chunk's first logical block begins."""
    L = RecordLayout
    saves = plan is not None
    return [
        "// gpushare: chunk dispatch (leader: flag check, then one atomic per chunk)",
        "$__gs_next:",
        *(_PARKED_BLOCK_STOPS if saves else ()),
        "@!%gs_leader bra $__gs_wait;",
        f"mov.u32 %gs_base, {NO_BLOCK};",
        *(_STOP_IF_PARKED if saves else ()),
        "ld.volatile.global.u32 %gs_flagv, [%gs_flag];",
        "setp.ne.u32 %gs_pseen, %gs_flagv, 0;",
        "@%gs_pseen bra $__gs_seen;",
        f"atom.global.add.u32 %gs_base, [%gs_prog+{L.NEXT_BLOCK}], %gs_chunk;",
        "bra $__gs_publish;",
        "$__gs_seen:",
        "mov.u64 %gs_now, %globaltimer;",
        f"red.global.min.u64 [%gs_prog+{L.FIRST_YIELD_NS}], %gs_now;",
        f"red.global.max.u64 [%gs_prog+{L.LAST_EXIT_NS}], %gs_now;",
        f"red.global.add.u32 [%gs_prog+{L.YIELD_EXITS}], 1;",
        "$__gs_publish:",
        "st.shared.u32 [%gs_sa], %gs_base;",
        "$__gs_wait:",
        "barrier.sync 0;",
        "ld.shared.u32 %gs_base, [%gs_sa];",
        "xor.b32 %gs_sa, %gs_sa, 4;",  # the other slot for the next chunk
        "setp.ge.u32 %gs_pend, %gs_base, %gs_stop;",
        "@%gs_pend bra $__gs_exit;",
        # The chunk is [base, min(base + chunk, stop)): ids >= stop are never run.
        "sub.u32 %gs_t, %gs_stop, %gs_base;",
        "min.u32 %gs_t, %gs_t, %gs_chunk;",
        "add.u32 %gs_lim, %gs_base, %gs_t;",
        "mov.u32 %gs_id, %gs_base;",
        "$__gs_block:",
        *BLOCK_COORDS,
        "// gpushare: original kernel body (one logical block)",
    ]


def _epilogue(sync: bool, plan: SavePlan | None, grouped: bool) -> list[str]:
    """The tail of the loop: the next logical block of the chunk or the next chunk, and
    the abort, exit and parking paths."""
    L = RecordLayout
    epilogue = [
        "$__gs_done:",
        "add.u32 %gs_id, %gs_id, 1;",
        "setp.lt.u32 %gs_pmore, %gs_id, %gs_lim;",
        "@!%gs_pmore bra $__gs_chunkend;",
    ]
    if sync:  # shared memory / barriers: the next logical block must not overlap
        epilogue.append("barrier.sync 0;")
    epilogue += [
        "bra $__gs_block;",
        "$__gs_chunkend:",
        # The barrier at $__gs_wait closes the chunk's last logical block.
        "sub.u32 %gs_t, %gs_lim, %gs_base;",
        f"@%gs_leader red.global.add.u32 [%gs_prog+{L.FINISHED}], %gs_t;",
        "bra $__gs_next;",
        "$__gs_abort:",
        *stop_marks(grouped),
        f"mov.u32 %gs_t, {NO_BLOCK};",
        "st.shared.u32 [__gs_slot], %gs_t;",
        "st.shared.u32 [__gs_slot+4], %gs_t;",
        "exit;",
        "$__gs_exit:",
        "@%gs_leader mov.u64 %gs_now, %globaltimer;",
        f"@%gs_leader red.global.max.u64 [%gs_prog+{L.END_NS}], %gs_now;",
        "ret;",
    ]
    if plan is not None:
        epilogue += _park(plan, grouped)
    return epilogue


def groups_stop_together(state: TransformState) -> bool:
    """Whether the module's PTX ISA has ``activemask`` (6.2 and later): without it every
    stopping thread writes its own marks."""
    major, _, minor = state.module.version.partition(".")
    return (int(major), int(minor or 0)) >= (6, 2)


def stop_marks(grouped: bool = True) -> list[str]:
    """What an aborting thread writes in the record before it exits: when (first sight
    of the flag, last exit), the lowest logical block stopped, and that the slice was
    aborted.  (A parking thread writes its block's shared slots instead:
    :func:`park_marks`.)

    ``grouped``: written by one thread per converged group of a warp, the lowest active
    lane; the group's threads stop together, at the same time and in the same logical
    block.  One write per thread put every resident thread's atomics on the same three
    words, serialised where they live: about 0.44 ms for a kernel that fills an H200,
    against 5 us for one block (benchmarks/results/2026-12-03-h200-cost-and-stops)."""
    L = RecordLayout
    lead = "@%gs_lead " if grouped else ""
    return [
        *(_lowest_active_lane() if grouped else ()),
        f"{lead}mov.u64 %gs_now, %globaltimer;",
        f"{lead}red.global.min.u64 [%gs_prog+{L.FIRST_YIELD_NS}], %gs_now;",
        f"{lead}red.global.max.u64 [%gs_prog+{L.LAST_EXIT_NS}], %gs_now;",
        # Every block below the lowest one an abort left is finished: an idempotent
        # kernel restarts there, not at 0 (re-running finished blocks is harmless).
        f"{lead}red.global.min.u32 [%gs_prog+{L.LOWEST_ABORTED}], %gs_id;",
        "mov.u32 %gs_t, 1;",
        f"{lead}st.global.u32 [%gs_prog+{L.ABORTED}], %gs_t;",
    ]


def _lowest_active_lane() -> list[str]:
    """``%gs_lead``: this thread is the lowest active lane of its converged group."""
    return [
        "activemask.b32 %gs_am;",
        "brev.b32 %gs_am, %gs_am;",
        "clz.b32 %gs_am, %gs_am;",
        "mov.u32 %gs_ln, %laneid;",
        "setp.eq.u32 %gs_lead, %gs_am, %gs_ln;",
    ]


def _indented(lines: list[str]) -> list[str]:
    """Instructions indented by a tab; labels at the line's start."""
    return ["\t" + s if not s.endswith(":") else s for s in lines]


def _entry_text(state: TransformState, head: list[str], tail: list[str]) -> str:
    """The entry with its top-level declarations first, then the loop's, the loop's head,
    the rewritten body and the loop's tail."""

    def top_level_decl(it: Item) -> bool:
        return it.stmt.kind == "decl" and it.stmt.depth == 0

    lines = [it.render() for it in state.body if top_level_decl(it)]
    lines += ["\t" + d for d in state.decls]
    lines += _indented(head)
    lines += [it.render() for it in state.body if not top_level_decl(it)]
    lines += _indented(tail)
    params = list(state.entry.params) + state.extra_params
    return render_entry(state.entry, body_lines=lines, params=params)


class PersistentBlocks(Pass):
    """Wrap the body in the persistent loop: flag check, chunk claim, broadcast, then the
    chunk's logical blocks back to back (ids decomposed into ``%ctaid`` replacements)."""

    name = "persistent-blocks"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        sync = needs_block_sync(state)
        state.notes.append(
            "barrier between logical blocks of a chunk" if sync else "chunk runs without barriers"
        )
        plan = state.save
        _add_params_and_decls(state, plan)
        head = _prologue(state, plan) + _dispatch(plan)
        state.text = _entry_text(state, head, _epilogue(sync, plan, groups_stop_together(state)))
        state.chunk_sync = sync
