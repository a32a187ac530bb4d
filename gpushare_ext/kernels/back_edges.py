"""Abort mode: flag checks at loop back edges, and tight loops unrolled first.

What it is for: :class:`UnrollTightLoops` (a tight loop's body copied so that a check
per round costs little) and :class:`BackEdgeChecks` (the yield flag read at back
edges, per thread or block-uniform; an aborting thread marks the record and exits, or
saves its state and parks where :func:`~gpushare_ext.kernels.saved_state.plan_save`
allows).

What it must not do: decide how an abort is undone (the launcher does), launch, or
touch CUDA.
"""

from __future__ import annotations

import re

from gpushare_ext.kernels.ptx import Instruction
from gpushare_ext.kernels.rewrite import Item, Pass, TransformState
from gpushare_ext.kernels.saved_state import plan_save

__all__ = [
    "CHECK_INSTRUCTIONS",
    "UNROLL",
    "UNROLL_MAX_BODY",
    "UNROLL_REST",
    "BackEdgeChecks",
    "UnrollTightLoops",
    "abort_check",
    "thread_check_every",
]

#: Copies of a tight loop's body per round in abort mode (see :class:`UnrollTightLoops`),
#: the copies of a counted loop's shorter rounds once fewer than ``UNROLL`` passes are
#: left, and the largest body (instructions) copied.
UNROLL = 32
UNROLL_REST = 8
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
    found = _zero_test(instrs, guard)
    if found is None:
        return None
    k_test, test, kind = found
    counter = test.operands[1]
    step = _decrement_of(instrs, counter, kind)
    if step is None:
        return None
    reads_guard = [ins for _, ins in instrs if ins is not test and guard in _guard_and_sources(ins)]
    if reads_guard:
        return None
    return counter, step, kind, k_test


def _zero_test(
    instrs: list[tuple[int, Instruction]], guard: str
) -> tuple[int, Instruction, str] | None:
    """``(index, test, type)`` of the one unguarded ``setp.ne.<type> guard, %r, 0`` that
    sets the back branch's predicate, if it is that."""
    tests = [(k, ins) for k, ins in instrs if _registers_of(ins.operands[:1]) == [guard]]
    if len(tests) != 1:
        return None
    k_test, test = tests[0]
    m = re.fullmatch(r"setp\.ne\.([su](?:32|64))", test.opcode)
    if m is None or len(test.operands) != 3 or test.operands[2] != "0" or test.guard:
        return None
    return k_test, test, m.group(1)


def _decrement_of(instrs: list[tuple[int, Instruction]], counter: str, kind: str) -> int | None:
    """The step when the counter's one definition is an unguarded
    ``add.<type> counter, counter, -step``."""
    defs = [ins for _, ins in instrs if ins.operands and ins.operands[0] == counter]
    if len(defs) != 1 or defs[0].guard or defs[0].opcode != f"add.{kind}":
        return None
    add = defs[0]
    if add.operands[1] != counter or not re.fullmatch(r"-\d+", add.operands[2]):
        return None
    return -int(add.operands[2])


def _registers_of(operands: tuple[str, ...] | list[str]) -> list[str]:
    return [r for o in operands for r in re.findall(r"%[A-Za-z_$][\w$]*", o)]


def _guard_and_sources(ins: Instruction) -> list[str]:
    regs = _registers_of(ins.operands[1:])
    return [*regs, ins.guard.lstrip("!")] if ins.guard else regs


def _counted_rounds(
    body: list[Item], branch: Item, at: int, exit_label: str,
    counter: str, step: int, kind: str, k_test: int,
) -> list[Item]:  # fmt: skip
    """While at least ``UNROLL`` passes are left (the counter is a multiple of the step
    on a loop that ends), ``UNROLL`` copies run with no test between them, and the flag
    check at the round's back branch; then rounds of ``UNROLL_REST`` copies while that
    many are left (at most a few, so they need no check), and the last passes one at a
    time. The header label stays the loop's one entry.

    Why 32 and the shorter rounds: on the H200 a one-block FMA loop (nothing else on the
    SM to hide a round's overhead) cost 1.15 x its original with 16 copies and 1.01 x
    with 32, a full-GPU one 1.03 and 0.94 x; the shorter rounds keep loops of a few dozen
    passes off the one-at-a-time path."""
    fast_body = [it for k, it in enumerate(body) if k != k_test]
    rest, slow = f"$__gs_looprest{at}", f"$__gs_loopslow{at}"
    signed = "s" + kind[1:]
    target = branch.stmt.instr.operands[0] if branch.stmt.instr is not None else ""
    guard = branch.stmt.instr.guard if branch.stmt.instr is not None else ""
    out = [
        Item.raw(f"setp.lt.{signed} %gs_pf, {counter}, {UNROLL * step};"),
        Item.raw(f"@%gs_pf bra {rest};"),
    ]
    for _ in range(UNROLL - 1):
        out += fast_body
    out += [*body, branch, Item.raw(f"bra {exit_label};"), Item.raw(f"{rest}:")]
    if 1 < UNROLL_REST < UNROLL:
        out += [
            Item.raw(f"setp.lt.{signed} %gs_pf, {counter}, {UNROLL_REST * step};"),
            Item.raw(f"@%gs_pf bra {slow};"),
        ]
        for _ in range(UNROLL_REST - 1):
            out += fast_body
        out += [*body, Item.raw(f"@{guard} bra {target};"), Item.raw(f"bra {exit_label};")]
    out += [Item.raw(f"{slow}:"), *body]
    out += [Item.raw(f"@{guard} bra {target};"), Item.raw(f"{exit_label}:")]
    return out


def _back_edge_checks(
    state: TransformState,
) -> tuple[dict[int, str], dict[int, int], dict[int, int]]:
    """Per instruction index a check goes before: its kind ("uniform" where the loop has
    barriers, else "thread"), its loop's header block, and the instructions in one pass
    of its loop (the smallest of the loops that share the latch)."""
    cfg = state.report.cfg
    instrs = state.entry.instructions
    barrier_blocks = {
        b for b, (s, e) in enumerate(cfg.blocks)
        if any(x.base in ("bar", "barrier") for x in instrs[s:e])
    }  # fmt: skip
    checks: dict[int, str] = {}
    headers: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for latch, header in cfg.back_edges:
        body = cfg.loop_bodies[(latch, header)]
        kind = "uniform" if body & barrier_blocks else "thread"
        _, e = cfg.blocks[latch]
        at = e - 1 if instrs[e - 1].base in ("bra", "brx") else e
        headers.setdefault(at, header)
        size = sum(cfg.blocks[b][1] - cfg.blocks[b][0] for b in body)
        sizes[at] = min(size, sizes.get(at, size))
        if checks.get(at) != "uniform":
            checks[at] = kind
    return checks, headers, sizes


class BackEdgeChecks(Pass):
    """Abort mode: check the yield flag at each loop back-edge. With ``save_state`` and a
    kernel that allows it (:func:`plan_save`), a stopping thread saves its live
    registers and parks instead of leaving its work to a restart."""

    name = "back-edge-checks"
    effect = "rewrite"

    def run(self, state: TransformState) -> None:
        instrs = state.entry.instructions
        checks, headers, sizes = _back_edge_checks(state)
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
            every = thread_check_every(sizes[at] * state.unrolled.get(at, 1))
            return [Item.raw(s) for s in abort_check(checks[at], n, park, every)]

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
        passes = sorted({thread_check_every(sizes[at] * state.unrolled.get(at, 1)) for at in order})
        state.notes.append(
            f"{len(checks)} back-edge flag checks (a thread reads the flag once in "
            f"{'/'.join(map(str, passes))} passes)"
        )


#: A per-thread back-edge check reads the flag about once per this many instructions of
#: its loop (a warp's, as written in the PTX).  Counted in instructions, not passes:
#: a thread's next read is what a stop waits for, and a pass is anything from a few
#: instructions to hundreds (Numba's FMA loop, unrolled, is about 270 a round: once in
#: 256 of its iterations left a stop's drain at 63 us on the H200, where CuPy's loops,
#: some 1,300 instructions between reads, drained in 13-21 us).  Fewer would cost: a
#: volatile load on every pass of a tight loop made a CuPy ElementwiseKernel about ten
#: times slower, and a read once per ~340 instructions cost 1-3 % more than per ~1,300.
CHECK_INSTRUCTIONS = 1024


def thread_check_every(loop_instructions: int) -> int:
    """Passes between two reads of the flag for a loop of ``loop_instructions`` per
    pass: the smallest power of two whose passes hold :data:`CHECK_INSTRUCTIONS`."""
    every = 1
    while every * max(1, loop_instructions) < CHECK_INSTRUCTIONS:
        every *= 2
    return every


def abort_check(kind: str, n: int, park_if: str | None, every: int) -> list[str]:
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
