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
* Saved aborts (abort mode, where :func:`plan_save` allows: no shared or local memory,
  no barriers, no warp collectives, no calls): a stopping thread instead stores the
  registers live at its check (register liveness, ``liveness.py``), its logical block,
  and its chunk's bounds in its cells of a save area (an extra parameter; cells are
  8-byte columns, one row per resident thread), then *parks*: it waits at the next
  chunk dispatch like its block's other threads, and a block with a parked thread
  claims no more chunks (its claim waits behind a barrier, so no thread misses its part
  of a claimed chunk). A thread parks only when its back edge is about to be taken, and
  saves what is live at that loop's header; the next slice's prologue reloads its
  registers and branches to the header (the loop's one entry, so it stays reducible). Nothing is undone: every (logical block,
  thread) pair runs exactly once, so the abort keeps all progress for any kernel.
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
from typing import Any

from gpushare_ext.kernels.analysis import analyse_entry
from gpushare_ext.kernels.ptx import (
    Entry,
    Instruction,
    KernelError,
    Param,
    PtxModule,
    Statement,
    render_entry,
)
from gpushare_ext.kernels.report import KernelReport

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
    #: an aborting thread saves its state (else an abort is undone by restart or
    #: rollback); ``saved_registers``: the registers it saves, in cell order
    saves_state: bool = False
    saved_registers: tuple[str, ...] = ()
    save_refusal: str = ""  # why an abort variant does not save state

    @property
    def save_cells(self) -> int:
        """8-byte cells per thread in the save area: tag, block id, chunk end, chunk
        base, then one per saved register."""
        return SAVE_HEADER_CELLS + len(self.saved_registers) if self.saves_state else 0


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


#: Copies of a tight loop's body per round in abort mode (see :class:`UnrollTightLoops`)
#: and the largest body (instructions) copied.
UNROLL = 8
UNROLL_MAX_BODY = 24


class UnrollTightLoops(Pass):
    """Abort mode: a loop of one basic block (``L: body; @%p bra L``) gets ``UNROLL``
    copies of its body per round, each but the last followed by the loop's own exit
    test, so the back-edge check below runs once a round.

    Why: a check inside a tight loop (a few FMAs per iteration, the loop of a CuPy
    ``ElementwiseKernel`` or a Numba kernel) keeps ptxas from unrolling it, and the
    kernel ran about three times slower on the H200 though the flag was read once in
    256 iterations. Bigger loops, loops with inner branches and loops marked
    ``nounroll`` keep one check per iteration (cheap beside their body)."""

    name = "unroll-tight-loops"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        cfg = state.report.cfg
        instrs = state.entry.instructions
        tight: dict[str, int] = {}  # header label -> index of its back branch
        for latch, header in cfg.back_edges:
            s, e = cfg.blocks[latch]
            last = instrs[e - 1]
            if latch != header or last.base != "bra" or not last.guard or e - s > UNROLL_MAX_BODY:
                continue
            if any(x.base in ("bar", "barrier") for x in instrs[s:e]):
                continue
            target = last.operands[0] if last.operands else ""
            if cfg.labels.get(target) == header:
                tight[target] = e - 1
        out: list[Item] = []
        body: list[Item] | None = None
        branch_at = -1
        for item in state.body:
            if body is None:
                out.append(item)
                if item.stmt.kind == "label" and item.stmt.text in tight:
                    body, branch_at = [], tight[item.stmt.text]
                continue
            if item.orig != branch_at:
                body.append(item)
                continue
            out += self._rounds(state, body, item, branch_at)
            body = None
        state.body = out

    @staticmethod
    def _rounds(state: TransformState, body: list[Item], branch: Item, at: int) -> list[Item]:
        if any(it.stmt.kind == "pragma" and "nounroll" in it.stmt.text for it in body):
            return [*body, branch]
        guard = branch.stmt.instr.guard if branch.stmt.instr is not None else None
        assert guard  # tight loops are chosen with a guarded back branch
        exit_label = f"$__gs_loopexit{at}"
        state.unrolled[at] = UNROLL
        counted = _countdown(body, guard)
        if counted is not None:
            return _counted_rounds(body, branch, at, exit_label, *counted)
        leave = guard[1:] if guard.startswith("!") else f"!{guard}"
        out: list[Item] = []
        for k in range(UNROLL):
            out += body
            if k < UNROLL - 1:
                out.append(Item.raw(f"@{leave} bra {exit_label};"))
        return [*out, branch, Item.raw(f"{exit_label}:")]


def _countdown(body: list[Item], guard: str) -> tuple[str, int, str, int] | None:
    """``(counter, step, type, index of the test)`` when the loop counts a register down
    to zero (``add.s32 %r, %r, -4; setp.ne.s32 %p, %r, 0; @%p bra L``, as NVVM emits
    its unrolled loops) and the test's predicate is read by the back branch only."""
    if guard.startswith("!"):
        return None
    instrs = [(k, it.stmt.instr) for k, it in enumerate(body) if it.stmt.instr is not None]
    tests = [(k, ins) for k, ins in instrs if _registers_of(ins.operands[:1]) == [guard]]
    if len(tests) != 1:
        return None
    k_test, test = tests[0]
    m = re.fullmatch(r"setp\.ne\.([su](?:32|64))", test.opcode)
    if m is None or len(test.operands) != 3 or test.operands[2] != "0" or test.guard:
        return None
    counter = test.operands[1]
    defs = [ins for _, ins in instrs if ins.operands and ins.operands[0] == counter]
    if len(defs) != 1 or defs[0].guard or defs[0].opcode != f"add.{m.group(1)}":
        return None
    add = defs[0]
    if add.operands[1] != counter or not re.fullmatch(r"-\d+", add.operands[2]):
        return None
    reads_guard = [ins for _, ins in instrs if ins is not test and guard in _guard_and_sources(ins)]
    if reads_guard:
        return None
    return counter, -int(add.operands[2]), m.group(1), k_test


def _registers_of(operands: tuple[str, ...] | list[str]) -> list[str]:
    return [r for o in operands for r in re.findall(r"%[A-Za-z_$][\w$]*", o)]


def _guard_and_sources(ins: Instruction) -> list[str]:
    regs = _registers_of(ins.operands[1:])
    return [*regs, ins.guard.lstrip("!")] if ins.guard else regs


def _counted_rounds(
    body: list[Item], branch: Item, at: int, exit_label: str,
    counter: str, step: int, kind: str, k_test: int,
) -> list[Item]:  # fmt: skip
    """While at least ``UNROLL`` iterations are left (the counter is a multiple of the
    step on a loop that ends), ``UNROLL`` copies run with no test between them; the last
    few iterations run one at a time. The header label stays the loop's one entry."""
    fast_body = [it for k, it in enumerate(body) if k != k_test]
    slow = f"$__gs_loopslow{at}"
    signed = "s" + kind[1:]
    out = [
        Item.raw(f"setp.lt.{signed} %gs_pf, {counter}, {UNROLL * step};"),
        Item.raw(f"@%gs_pf bra {slow};"),
    ]
    for _ in range(UNROLL - 1):
        out += fast_body
    out += body
    out += [branch, Item.raw(f"bra {exit_label};"), Item.raw(f"{slow}:"), *body]
    target = branch.stmt.instr.operands[0] if branch.stmt.instr is not None else ""
    guard = branch.stmt.instr.guard if branch.stmt.instr is not None else ""
    out += [Item.raw(f"@{guard} bra {target};"), Item.raw(f"{exit_label}:")]
    return out


class BackEdgeChecks(Pass):
    """Abort mode: check the yield flag at each loop back-edge. With ``save_state`` and a
    kernel that allows it (:func:`plan_save`), a stopping thread saves its live
    registers and parks instead of leaving its work to a restart."""

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
        headers: dict[int, int] = {}  # the same index -> the loop header block
        for latch, header in cfg.back_edges:
            body = cfg.loop_bodies[(latch, header)]
            kind = "uniform" if body & barrier_blocks else "thread"
            _, e = cfg.blocks[latch]
            at = e - 1 if instrs[e - 1].base in ("bra", "brx") else e
            headers.setdefault(at, header)
            if checks.get(at) != "uniform":
                checks[at] = kind
        order = sorted(checks)
        if state.options.save_state and checks:
            plan = plan_save(state, {at: checks[at] for at in order}, headers)
            if isinstance(plan, str):
                state.save_refusal = plan
                state.notes.append(f"aborts are undone, not saved: {plan}")
            else:
                state.save = plan
                state.notes.append(f"an aborting thread saves {len(plan.registers)} live registers")
        number = {at: n for n, at in enumerate(order)}
        plan = state.save

        def check(at: int) -> list[Item]:
            n = number[at]
            park = plan.park_if.get(n, "") if plan is not None else None
            every = max(1, THREAD_CHECK_EVERY // state.unrolled.get(at, 1))
            return [Item.raw(s) for s in _abort_check(checks[at], n, park, every)]

        out: list[Item] = []
        for item in state.body:
            if item.orig is not None and item.orig in checks:
                out += check(item.orig)
            out.append(item)
        # A check "after" the last instruction of a latch that falls through.
        for at in order:
            if at >= len(instrs):
                out += check(at)
        state.body = out
        state.notes.append(f"{len(checks)} back-edge flag checks")


#: A per-thread back-edge check reads the flag once in this many iterations: a volatile
#: load on every iteration of a tight loop makes it memory-latency bound (measured: a
#: CuPy ElementwiseKernel's FMA loop ran about ten times slower), and a few hundred
#: iterations are still well under a microsecond.  A power of two.
THREAD_CHECK_EVERY = 256


def _abort_check(
    kind: str, n: int, park_if: str | None = None, every: int = THREAD_CHECK_EVERY
) -> list[str]:
    """Check ``n``, reading the flag once in ``every`` passes (a power of two).
    ``park_if`` (saving variants): the back edge's own condition (a predicate, ``!`` a
    negated one, ``""`` always); the thread parks only when it is about to go round
    again, so that it goes on at the loop header."""
    if kind == "thread":
        out = [
            f"// gpushare: back-edge yield check (per thread, every {every})",
            "add.u32 %gs_bc, %gs_bc, 1;",
            f"and.b32 %gs_bm, %gs_bc, {every - 1};",
            "setp.ne.u32 %gs_pb, %gs_bm, 0;",
            f"@%gs_pb bra $__gs_nocheck{n};",
            "ld.volatile.global.u32 %gs_flagv, [%gs_flag];",
            "setp.ne.u32 %gs_pa, %gs_flagv, 0;",
        ]
        if park_if is None:
            out.append("@%gs_pa bra $__gs_abort;")
        else:
            if park_if.startswith("!"):
                out += [f"not.pred %gs_pb, {park_if[1:]};", "and.pred %gs_pa, %gs_pa, %gs_pb;"]
            elif park_if:
                out.append(f"and.pred %gs_pa, %gs_pa, {park_if};")
            out.append(f"@%gs_pa bra $__gs_save{n};")
        out.append(f"$__gs_nocheck{n}:")
        return out
    return [
        "// gpushare: back-edge yield check (block-uniform: the loop has barriers)",
        "@%gs_leader ld.volatile.global.u32 %gs_flagv, [%gs_flag];",
        "@%gs_leader st.shared.u32 [__gs_abortslot], %gs_flagv;",
        "barrier.sync 0;",
        "ld.shared.u32 %gs_flagv, [__gs_abortslot];",
        "setp.ne.u32 %gs_pa, %gs_flagv, 0;",
        "@%gs_pa bra $__gs_abort;",
    ]


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
    #: edge's condition (see :func:`_abort_check`)
    resume_at: dict[int, str] = field(default_factory=dict)
    park_if: dict[int, str] = field(default_factory=dict)
    #: check number -> instructions a reload runs again instead of reading cells (the
    #: live registers :func:`~gpushare_ext.kernels.liveness.recomputable_registers` finds)
    recompute: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def cell(self, register: str) -> int:
        return SAVE_HEADER_CELLS + self.registers.index(register)


def _save_refusal(state: TransformState, checks: dict[int, str]) -> str | None:
    """Why this kernel's threads cannot stop and go on from saved registers, or None.

    A thread's whole state must be its registers: no shared or local memory, no
    barriers (threads of a block stop at different points), no warp collectives and no
    calls (a callee's frame is not in the entry's registers)."""
    if any(kind == "uniform" for kind in checks.values()):
        return "a loop has barriers"
    if _needs_block_sync(state):
        return "it uses shared memory or barriers"
    for s in state.entry.body:
        if s.kind == "decl" and s.text.lstrip().startswith(".local"):
            return "it uses local memory"
    for ins in state.entry.instructions:
        if ins.base == "call":
            return "it calls a function"
        if ins.base in _WARP_COLLECTIVES:
            return f"it uses the warp collective {ins.opcode}"
        if ins.state_space == "local" or any("%SP" in o for o in ins.operands):
            return "it uses local memory"
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


def _save_stub(plan: SavePlan, n: int) -> list[str]:
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


def _restore_stub(plan: SavePlan, n: int) -> list[str]:
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


def _resume_saved(plan: SavePlan) -> list[str]:
    """Prologue of a state-saving variant: find this thread's cell, and if an earlier
    slice left it stopped mid-chunk, reload the chunk position and go on where it was."""
    out = [
        "// gpushare: a thread stopped by an earlier slice goes on where it was",
        *_thread_cells(),
        # The block's "a thread parked" mark, cleared before anyone can set it.
        "mov.u32 %gs_t, 0;",
        "@%gs_leader st.shared.u32 [__gs_stopped], %gs_t;",
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
        *_BLOCK_COORDS,
    ]
    for n in sorted(plan.live):
        out += [f"setp.eq.u32 %gs_pr, %gs_tag, {n + 1};", f"@%gs_pr bra $__gs_restore{n};"]
    out.append("bra $__gs_next;")
    return out


_BLOCK_COORDS = (
    "rem.u32 %gs_cx, %gs_id, %gs_nx;",
    "div.u32 %gs_t, %gs_id, %gs_nx;",
    "rem.u32 %gs_cy, %gs_t, %gs_ny;",
    "div.u32 %gs_cz, %gs_id, %gs_nxy;",
)

# State-saving variants claim a chunk only once every thread of the block has finished
# the last one or parked (a barrier before the claim), and claim none once one parked:
# a parked thread owes the rest of its chunk, and must not miss its part of the next.
_PARKED_BLOCK_STOPS = ("barrier.sync 0;",)
_STOP_IF_PARKED = (
    "ld.shared.u32 %gs_t, [__gs_stopped];",
    "setp.ne.u32 %gs_pr, %gs_t, 0;",
    "@%gs_pr bra $__gs_publish;",
)


def _park(plan: SavePlan) -> list[str]:
    """The save and reload stubs, and the parking path: a thread that saved its state
    marks the record and its block, then waits at the next dispatch like the others
    (it does not exit, so the block's barriers keep counting it)."""
    L = RecordLayout
    out: list[str] = []
    for n in sorted(plan.live):
        out += _save_stub(plan, n)
    for n in sorted(plan.live):
        out += _restore_stub(plan, n)
    out += [
        "$__gs_park:",
        "mov.u64 %gs_now, %globaltimer;",
        f"red.global.min.u64 [%gs_prog+{L.FIRST_YIELD_NS}], %gs_now;",
        f"red.global.max.u64 [%gs_prog+{L.LAST_EXIT_NS}], %gs_now;",
        f"red.global.min.u32 [%gs_prog+{L.LOWEST_ABORTED}], %gs_id;",
        "mov.u32 %gs_t, 1;",
        f"st.global.u32 [%gs_prog+{L.ABORTED}], %gs_t;",
        "st.shared.u32 [__gs_stopped], %gs_t;",
        "bra $__gs_next;",
    ]
    return out


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
        plan = state.save
        if plan is not None:
            state.extra_params[7:7] = [
                Param("__gs_save", "u64", 8, 8),
                Param("__gs_savestride", "u64", 8, 8),
            ]
        state.decls[:0] = [
            ".reg .b64 %gs_prog0, %gs_prog, %gs_flag0, %gs_flag, %gs_now, %gs_scratch, %gs_scratch_g;",
            ".reg .b32 %gs_nx, %gs_ny, %gs_nz, %gs_stop, %gs_nxy, %gs_t, %gs_t2, %gs_id, %gs_flagv;",
            ".reg .b32 %gs_cx, %gs_cy, %gs_cz, %gs_chunk, %gs_base, %gs_lim, %gs_sa, %gs_bc, %gs_bm;",
            ".reg .pred %gs_leader, %gs_pseen, %gs_pend, %gs_pa, %gs_pb, %gs_pmore, %gs_pf;",
            # Two slots, used alternately by consecutive chunks: the leader can write the
            # next chunk's base while a slow warp still reads this one's (one barrier per
            # chunk instead of two).
            ".shared .align 8 .b32 __gs_slot[2];",
            ".shared .align 4 .b32 __gs_abortslot;",
        ]
        if plan is not None:
            state.decls += [
                ".reg .b64 %gs_sv0, %gs_sv, %gs_sst, %gs_sp;",
                ".reg .b32 %gs_g, %gs_tag;",
                ".reg .pred %gs_pr;",
                ".shared .align 4 .b32 __gs_stopped;",  # a thread of the block parked
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
            *(_resume_saved(plan) if plan is not None else ()),
        ]
        dispatch = [
            "// gpushare: chunk dispatch (leader: flag check, then one atomic per chunk)",
            "$__gs_next:",
            *(_PARKED_BLOCK_STOPS if plan is not None else ()),
            "@!%gs_leader bra $__gs_wait;",
            f"mov.u32 %gs_base, {NO_BLOCK};",
            *(_STOP_IF_PARKED if plan is not None else ()),
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
            *_BLOCK_COORDS,
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
        if plan is not None:
            epilogue += _park(plan)
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
        passes += [UnrollTightLoops(), BackEdgeChecks()]
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
        saves_state=state.save is not None,
        saved_registers=state.save.registers if state.save is not None else (),
        save_refusal=state.save_refusal,
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
