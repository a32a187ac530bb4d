"""PTX rewrites: persistent preemptible blocks, back-edge abort checks, address fences.

What it is for: turning one kernel entry into a *preemptible* kernel the launcher
(``launch.py``) can stop and continue. The rewrite is a named pipeline of passes (one
class per pass, each with a name and a declared effect), text in and text out, so every
step is tested on PTX files without a GPU and a failure names the step that failed.

The scheme (documented for users in ``docs/kernels.md``):

* The launch starts at most K *persistent* blocks. Each loops over *chunks*: its leader
  thread (thread 0,0,0) first reads the session's yield flag (device memory,
  ``ld.volatile``). If the flag is clear it claims the next ``chunk`` consecutive
  *logical block ids* with one ``atom.add`` of ``chunk`` on the progress record's counter;
  if set it claims nothing. It publishes the chunk's base (or "stop") through shared
  memory (two slots used alternately), ``barrier.sync``; every thread reads it, so the
  exit is block-uniform. The block then runs the ids ``[base, min(base + chunk, stop))``
  back to back; ``chunk`` is a kernel parameter chosen per launch (``launch.py``).
* The logical id replaces ``%ctaid.x/y/z`` (decomposed with the original grid dims,
  extra parameters that also replace ``%nctaid``). ``ret`` becomes a branch to the
  logical block's end. Between two logical blocks of a chunk there is a barrier only if
  the kernel has barriers or uses shared memory (reuse hazards); the barrier of the next
  dispatch closes a chunk's last logical block.
* Chunks are all-or-nothing: ids are claimed only after a clear flag check and a block
  runs every id it claimed before it looks at the flag again. So every id below the
  counter (and below ``stop``) is finished when the kernel exits, and *resume* relaunches
  with the same record and goes on. A yield waits for at most one chunk per persistent
  block.
* A launch may also stop at ``stop`` (an extra parameter): ids >= stop are not run, so
  the host can cut a launch into slices (time quanta, deterministic preemption in tests).
* Abort mode adds flag checks at loop back-edges (per thread in loops without
  barriers, block-uniform through shared memory in loops with them); an aborting
  thread marks the record and exits. The launch is then undone by the launcher
  (restart if idempotent, snapshot rollback otherwise).
* Fencing (Guardian-style): every global load/store/atomic address whose buffer the
  analysis knows is checked against that buffer's base/size (extra parameters); an
  address outside is redirected to a scratch area in the progress record and counted.

Progress record (``PROGRESS_RECORD_BYTES`` bytes of device memory per launch)::

    +0  u32 next logical block (atomic counter)     +4  u32 finished logical blocks
    +8  u64 first yield seen (%globaltimer, min)    +16 u64 last yield exit (max)
    +24 u64 fenced (neutralised) accesses           +32 u32 aborted mid-block (0/1)
    +36 u32 persistent blocks that left on a yield  +40 u64 first block start (min)
    +48 u64 last block exit (max)                   +56 u32 lowest block aborted in (min)
    +64 64-byte fence scratch area

What it must not do: launch anything or touch CUDA (``launch.py`` does), or change
``.version``/``.target`` (the transformed text keeps the input's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gpushare_ext.kernels.analysis import KernelReport, analyse_entry
from gpushare_ext.kernels.ptx import (
    Entry,
    Instruction,
    KernelError,
    Param,
    PtxModule,
    Statement,
    render_entry,
)

__all__ = [
    "PROGRESS_RECORD_BYTES",
    "Pass",
    "Pipeline",
    "PreemptibleKernel",
    "RecordLayout",
    "TransformOptions",
    "assemble",
    "find_ptxas",
    "make_preemptible",
]

PROGRESS_RECORD_BYTES = 128
NO_BLOCK = 0xFFFFFFFF


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
    ``fence``: clamp global accesses to the declared buffers."""

    abort_checks: bool = False
    fence: bool = False

    @property
    def key(self) -> str:
        return f"{'abort' if self.abort_checks else 'yield'}{'+fence' if self.fence else ''}"


@dataclass(frozen=True)
class PreemptibleKernel:
    """A transformed kernel: its PTX and the extra parameters the launch must append."""

    name: str
    ptx: str
    options: TransformOptions
    original_params: tuple[Param, ...]
    extra_params: tuple[Param, ...]
    fenced_params: tuple[str, ...]  # for each: base then size in extra_params
    steps: tuple[str, ...]  # names of the passes that ran
    chunk_sync: bool = True  # a barrier between the logical blocks of a chunk


# ---------------------------------------------------------------------------------------
# Working state and passes
# ---------------------------------------------------------------------------------------


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


class FenceGlobalAccesses(Pass):
    """Clamp each global load/store/atomic to the declared buffers (Guardian-style)."""

    name = "fence-global-accesses"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        report = state.report
        fenced = list(report.buffers)
        state.fenced = fenced
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
        by_index = {a.index: a for a in report.accesses}
        out: list[Item] = []
        count = 0
        for item in state.body:
            acc = by_index.get(item.orig) if item.orig is not None else None
            ins = item.stmt.instr
            if acc is None or ins is None:
                out.append(item)
                continue
            if acc.origin.startswith("module-var:"):
                out.append(item)
                continue
            cands = list(acc.params) if acc.params else list(fenced)
            addr_op = next(o for o in ins.operands if o.startswith("["))
            addr = addr_op[1:-1].strip()
            is_global = ins.state_space == "global"
            width = ins.access_width
            seq = [f"// gpushare fence: {ins.opcode} at PTX line {ins.line}"]
            m = re.match(r"^(.+?)\s*\+\s*(-?\w+)$", addr)
            if m:
                seq.append(f"add.s64 %gs_fa, {m.group(1).strip()}, {m.group(2)};")
            else:
                seq.append(f"mov.b64 %gs_fa, {addr};")
            if not cands:
                seq.append(
                    "setp.ne.u32 %gs_fok, %gs_nx, %gs_nx;"
                )  # nothing declared: never in range
            for j, p in enumerate(cands):
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
            scratch = "%gs_scratch_g" if is_global else "%gs_scratch"
            seq.append(f"selp.b64 %gs_fa, %gs_fa, {scratch}, %gs_fok;")
            seq.append("not.pred %gs_fbad, %gs_fok;")
            if ins.guard:
                g = ins.guard
                if g.startswith("!"):
                    seq.append(f"not.pred %gs_fgd, {g[1:]};")
                    seq.append("and.pred %gs_fbad, %gs_fbad, %gs_fgd;")
                else:
                    seq.append(f"and.pred %gs_fbad, %gs_fbad, {g};")
            seq.append(f"@%gs_fbad red.global.add.u64 [%gs_prog+{RecordLayout.FENCED}], 1;")
            out += [Item.raw(s) for s in seq]
            ops = tuple("[%gs_fa]" if o == addr_op else o for o in ins.operands)
            out.append(
                _replace_instr(
                    item, Instruction(ins.opcode, ops, ins.guard, ins.line, ins.src_line)
                )
            )
            count += 1
        state.body = out
        state.notes.append(f"fenced {count} global accesses over {len(fenced)} buffers")


class BackEdgeChecks(Pass):
    """Abort mode: check the yield flag at each loop back-edge."""

    name = "back-edge-checks"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        report = state.report
        cfg = report.cfg
        instrs = state.entry.instructions
        barrier_blocks = {
            b for b, (s, e) in enumerate(cfg.blocks)
            if any(x.base in ("bar", "barrier") for x in instrs[s:e])
        }  # fmt: skip
        checks: dict[int, str] = {}  # instruction index to insert before -> "uniform"/"thread"
        for latch, header in cfg.back_edges:
            body = cfg.loop_bodies[(latch, header)]
            kind = "uniform" if body & barrier_blocks else "thread"
            _, e = cfg.blocks[latch]
            at = e - 1 if instrs[e - 1].base in ("bra", "brx") else e
            if checks.get(at) != "uniform":
                checks[at] = kind
        out: list[Item] = []
        n = 0
        for item in state.body:
            if item.orig is not None and item.orig in checks:
                out += [Item.raw(s) for s in _abort_check(checks[item.orig], n)]
                n += 1
            out.append(item)
        # A check "after" the last instruction of a latch that falls through.
        tail = [k for k in checks if k >= len(instrs)]
        for k in tail:
            out += [Item.raw(s) for s in _abort_check(checks[k], n)]
        state.body = out
        state.notes.append(f"{len(checks)} back-edge flag checks")


#: A per-thread back-edge check reads the flag once in this many iterations: a volatile
#: load on every iteration of a tight loop makes it memory-latency bound (measured: a
#: CuPy ElementwiseKernel's FMA loop ran about ten times slower), and a few hundred
#: iterations are still well under a microsecond.  A power of two.
THREAD_CHECK_EVERY = 256


def _abort_check(kind: str, n: int) -> list[str]:
    if kind == "thread":
        return [
            f"// gpushare: back-edge yield check (per thread, every {THREAD_CHECK_EVERY})",
            "add.u32 %gs_bc, %gs_bc, 1;",
            f"and.b32 %gs_bm, %gs_bc, {THREAD_CHECK_EVERY - 1};",
            "setp.ne.u32 %gs_pb, %gs_bm, 0;",
            f"@%gs_pb bra $__gs_nocheck{n};",
            "ld.volatile.global.u32 %gs_flagv, [%gs_flag];",
            "setp.ne.u32 %gs_pa, %gs_flagv, 0;",
            "@%gs_pa bra $__gs_abort;",
            f"$__gs_nocheck{n}:",
        ]
    return [
        "// gpushare: back-edge yield check (block-uniform: the loop has barriers)",
        "@%gs_leader ld.volatile.global.u32 %gs_flagv, [%gs_flag];",
        "@%gs_leader st.shared.u32 [__gs_abortslot], %gs_flagv;",
        "barrier.sync 0;",
        "ld.shared.u32 %gs_flagv, [__gs_abortslot];",
        "setp.ne.u32 %gs_pa, %gs_flagv, 0;",
        "@%gs_pa bra $__gs_abort;",
    ]


def _needs_block_sync(state: TransformState) -> bool:
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


class PersistentBlocks(Pass):
    """Wrap the body in the persistent loop: flag check, chunk claim, broadcast, then the
    chunk's logical blocks back to back (ids decomposed into ``%ctaid`` replacements)."""

    name = "persistent-blocks"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        L = RecordLayout
        sync = _needs_block_sync(state)
        state.notes.append(
            "barrier between logical blocks of a chunk" if sync else "chunk runs without barriers"
        )
        state.extra_params[:0] = [
            Param("__gs_progress", "u64", 8, 8),
            Param("__gs_yieldflag", "u64", 8, 8),
            Param("__gs_gridx", "u32", 4, 4),
            Param("__gs_gridy", "u32", 4, 4),
            Param("__gs_gridz", "u32", 4, 4),
            Param("__gs_stop", "u32", 4, 4),
            Param("__gs_chunk", "u32", 4, 4),
        ]
        state.decls[:0] = [
            ".reg .b64 %gs_prog0, %gs_prog, %gs_flag0, %gs_flag, %gs_now, %gs_scratch, %gs_scratch_g;",
            ".reg .b32 %gs_nx, %gs_ny, %gs_nz, %gs_stop, %gs_nxy, %gs_t, %gs_t2, %gs_id, %gs_flagv;",
            ".reg .b32 %gs_cx, %gs_cy, %gs_cz, %gs_chunk, %gs_base, %gs_lim, %gs_sa, %gs_bc, %gs_bm;",
            ".reg .pred %gs_leader, %gs_pseen, %gs_pend, %gs_pa, %gs_pb, %gs_pmore;",
            # Two slots, used alternately by consecutive chunks: the leader can write the
            # next chunk's base while a slow warp still reads this one's (one barrier per
            # chunk instead of two).
            ".shared .align 8 .b32 __gs_slot[2];",
            ".shared .align 4 .b32 __gs_abortslot;",
        ]
        prologue = [
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
        ]
        dispatch = [
            "// gpushare: chunk dispatch (leader: flag check, then one atomic per chunk)",
            "$__gs_next:",
            "@!%gs_leader bra $__gs_wait;",
            f"mov.u32 %gs_base, {NO_BLOCK};",
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
            "rem.u32 %gs_cx, %gs_id, %gs_nx;",
            "div.u32 %gs_t, %gs_id, %gs_nx;",
            "rem.u32 %gs_cy, %gs_t, %gs_ny;",
            "div.u32 %gs_cz, %gs_id, %gs_nxy;",
            "// gpushare: original kernel body (one logical block)",
        ]
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
            "mov.u64 %gs_now, %globaltimer;",
            f"red.global.min.u64 [%gs_prog+{L.FIRST_YIELD_NS}], %gs_now;",
            f"red.global.max.u64 [%gs_prog+{L.LAST_EXIT_NS}], %gs_now;",
            # Every block below the lowest one an abort left is finished: an idempotent
            # kernel restarts there, not at 0 (re-running finished blocks is harmless).
            f"red.global.min.u32 [%gs_prog+{L.LOWEST_ABORTED}], %gs_id;",
            f"mov.u32 %gs_t, {NO_BLOCK};",
            "st.shared.u32 [__gs_slot], %gs_t;",
            "st.shared.u32 [__gs_slot+4], %gs_t;",
            "mov.u32 %gs_t, 1;",
            f"st.global.u32 [%gs_prog+{L.ABORTED}], %gs_t;",
            "exit;",
            "$__gs_exit:",
            "@%gs_leader mov.u64 %gs_now, %globaltimer;",
            f"@%gs_leader red.global.max.u64 [%gs_prog+{L.END_NS}], %gs_now;",
            "ret;",
        ]
        top_decls = [it for it in state.body if it.stmt.kind == "decl" and it.stmt.depth == 0]
        rest = [it for it in state.body if not (it.stmt.kind == "decl" and it.stmt.depth == 0)]
        lines = [it.render() for it in top_decls]
        lines += ["\t" + d for d in state.decls]
        lines += ["\t" + s if not s.endswith(":") else s for s in prologue + dispatch]
        lines += [it.render() for it in rest]
        lines += ["\t" + s if not s.endswith(":") else s for s in epilogue]
        params = list(state.entry.params) + state.extra_params
        state.text = render_entry(state.entry, body_lines=lines, params=params)
        state.chunk_sync = sync


def _base_passes(options: TransformOptions) -> tuple[Pass, ...]:
    passes: list[Pass] = [CheckSupported(), RewriteBlockIds()]
    if options.fence:
        passes.append(FenceGlobalAccesses())
    if options.abort_checks:
        passes.append(BackEdgeChecks())
    passes += [RewriteReturns(), PersistentBlocks()]
    return tuple(passes)


def pipeline_for(options: TransformOptions) -> Pipeline:
    return Pipeline(f"preemptible[{options.key}]", _base_passes(options))


def make_preemptible(
    module: PtxModule,
    name: str,
    options: TransformOptions | None = None,
    *,
    report: KernelReport | None = None,
) -> PreemptibleKernel:
    """Rewrite kernel ``name`` of ``module``; returns the whole module's new PTX text."""
    options = options or TransformOptions()
    entry = module.entry(name)
    if report is None:
        report = analyse_entry(module, entry)
    index = 0
    body: list[Item] = []
    for s in entry.body:
        if s.kind == "instr":
            body.append(Item(s, index))
            index += 1
        else:
            body.append(Item(s))
    state = TransformState(module, entry, report, options, body)
    pipe = pipeline_for(options)
    steps = pipe.run(state)
    ptx = module.render({name: state.text})
    return PreemptibleKernel(
        name=name,
        ptx=ptx,
        options=options,
        original_params=tuple(entry.params),
        extra_params=tuple(state.extra_params),
        fenced_params=tuple(state.fenced),
        steps=tuple(steps),
        chunk_sync=state.chunk_sync,
    )


# ---------------------------------------------------------------------------------------
# Assembling with ptxas (the last step; CPU only)
# ---------------------------------------------------------------------------------------


def find_ptxas() -> str:
    """ptxas from the ``nvidia-cuda-nvcc`` wheel, else ``$PTXAS``, else on PATH."""
    env = os.environ.get("GPUSHARE_PTXAS")
    if env:
        return env
    for root in sys.path:
        for rel in ("nvidia/cu13/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas", "nvidia/cu12/bin/ptxas"):
            cand = Path(root) / rel
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    found = shutil.which("ptxas")
    if found:
        return found
    raise KernelError(
        "no-ptxas",
        "ptxas not found: install the nvidia-cuda-nvcc wheel (pip install nvidia-cuda-nvcc) "
        "or set GPUSHARE_PTXAS",
        step="assemble",
    )


def assemble(ptx: str, arch: str = "sm_90", *, ptxas: str | None = None) -> bytes:
    """Assemble with ptxas; returns the cubin. Raises KernelError with ptxas's log."""
    exe = ptxas or find_ptxas()
    with tempfile.TemporaryDirectory(prefix="gpushare-ptxas-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        out = Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        proc = subprocess.run(
            [exe, f"-arch={arch}", "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise KernelError(
                "ptxas-failed",
                f"ptxas rejected the PTX for {arch}",
                step="assemble",
                log=_annotate_ptxas_log(proc.stderr + proc.stdout, ptx),
            )
        return out.read_bytes()


def _annotate_ptxas_log(log: str, ptx: str) -> str:
    lines = ptx.splitlines()
    out = [log.rstrip()]
    for m in re.finditer(r"line (\d+)", log):
        n = int(m.group(1))
        if 0 < n <= len(lines):
            out.append(f"  {n}: {lines[n - 1].strip()}")
    return "\n".join(out)
