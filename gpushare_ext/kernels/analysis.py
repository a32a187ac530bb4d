"""What a kernel does to its buffers: the analysis of one entry, run as named steps.

What it is for: given a parsed entry (``ptx.py``), build its control flow and taint
(``dataflow.py``), follow every pointer parameter from ``ld.param`` through
``cvta``/address arithmetic to the ``ld``/``st``/``atom``/``red`` instructions that
touch global memory, and say per parameter whether the kernel reads it, writes it,
both, or cannot tell; find what keeps it from being transformed (grid-wide
synchronisation, block-id reads it cannot rewrite, early exits before barriers); then
classify it (``classification.py``) into a :class:`~gpushare_ext.kernels.report.KernelReport`.
Each step has a name, and an unexpected failure in one says which
(:class:`AnalysisFailed`).

What it must not do: rewrite PTX or touch CUDA. It over-approximates where it must
(a write it cannot attribute makes the kernel *unknown*, never *idempotent*).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import ParamSpec, TypeVar

from gpushare_ext.kernels.callees import call_refusal
from gpushare_ext.kernels.classification import NON_IDEMPOTENT_ATOMICS, atomic_op, classify
from gpushare_ext.kernels.dataflow import (
    LOADED,
    LOCAL,
    SHARED,
    SYM,
    address_of,
    build_cfg,
    compute_taint,
    dests_and_sources,
    ends_thread,
    is_branch,
    named_variables,
    operand_taint,
    registers_in,
    struct_pointer_fields,
    varying_registers,
)
from gpushare_ext.kernels.ptx import Entry, Instruction, KernelError, PtxModule
from gpushare_ext.kernels.report import (
    Access,
    BufferUse,
    Classification,
    ControlFlow,
    Idempotence,
    KernelReport,
    MemoryAccess,
)
from gpushare_ext.kernels.signatures import kernel_name

__all__ = ["AnalysisFailed", "analyse_entry", "analyse_module"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

_MEMORY_OPS = {"ld", "ldu", "st", "atom", "red"}


def _is_barrier(ins: Instruction) -> bool:
    return (
        ins.base in ("bar", "barrier")
        and "cluster" not in ins.parts
        and ("sync" in ins.parts or "red" in ins.parts or len(ins.parts) == 1)
    )


def analyse_entry(
    module: PtxModule,
    entry: Entry,
    *,
    pointer_params: Iterable[str] | None = None,
) -> KernelReport:
    """Analyse one entry. ``pointer_params`` narrows which params are buffers (Numba ABI).

    The steps run in this order, each named: control flow, candidate pointers, taint,
    definite pointers, memory accesses, buffers, barriers, grid sync, block-id uses,
    early exits, then the classification.  A step that fails on something it did not
    expect raises :class:`AnalysisFailed`, which names it.
    """
    step = _Steps(entry).run
    instrs = entry.instructions
    cfg = step("control flow", build_cfg, entry)
    candidates = step("candidate pointers", _candidate_pointers, entry, pointer_params)
    taint = step("taint", compute_taint, entry, candidates, module.module_vars)
    definite = step(
        "definite pointers", _definite_pointers, instrs, taint, module.module_vars, candidates
    )
    accesses, atomics, unsupported = step(
        "memory accesses", _memory_accesses, module, entry, taint, candidates, definite
    )
    own_reads = step("buffers", _own_write_reads, entry, cfg, accesses)
    buffers = step("buffers", _buffers, entry, candidates, accesses, definite, own_reads)
    barriers = step("barriers", _barriers, instrs)
    grid_sync = step("grid sync", _grid_sync, instrs, cfg)
    uses_ctaid, uses_nctaid, refused = step("block-id uses", _block_id_uses, module, instrs)
    early_exits, hazards = step("early exits", _early_exits, entry, cfg, barriers)
    report = KernelReport(
        entry=entry,
        cfg=cfg,
        buffers=buffers,
        accesses=accesses,
        classification=Classification(Idempotence.UNKNOWN, ()),
        atomics=atomics,
        barriers=barriers,
        grid_sync=grid_sync,
        loaded_pointers=[a for a in accesses if a.origin == "loaded"],
        early_exits=early_exits,
        early_exit_hazards=hazards,
        uses_ctaid=frozenset(uses_ctaid),
        uses_nctaid=frozenset(uses_nctaid),
        unsupported=list(dict.fromkeys(unsupported + refused)),
        taint=taint,
    )
    report.classification = step("classification", classify, report, module)
    return report


class AnalysisFailed(KernelError):
    """A step of the analysis failed on something it did not expect (a bug or a PTX
    construct it does not know): the one-line message names the step and the kernel,
    and the original error is chained."""

    def __init__(self, kernel: str, step: str, error: Exception) -> None:
        lines = str(error).strip().splitlines()
        what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        super().__init__(
            "analysis-failed",
            f"analysis of `{kernel}` failed at step '{step}': {what}",
            step=f"analyse:{step}",
        )
        self.failed_step = step


class _Steps:
    """Runs the named steps of one entry's analysis."""

    def __init__(self, entry: Entry) -> None:
        self._entry = entry

    def run(self, name: str, step: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return step(*args, **kwargs)
        except KernelError:
            raise  # refused on purpose: already says why
        except Exception as exc:
            raise AnalysisFailed(kernel_name(self._entry.name), name, exc) from exc


def _barriers(instrs: list[Instruction]) -> list[Instruction]:
    return [ins for ins in instrs if _is_barrier(ins)]


def _candidate_pointers(entry: Entry, pointer_params: Iterable[str] | None) -> list[str]:
    """Parameters (and by-value struct fields) that may be buffers."""
    candidates = [p.name for p in entry.params if p.may_be_pointer]
    candidates += struct_pointer_fields(entry)
    if pointer_params is not None:
        allowed = set(pointer_params)
        candidates = [p for p in candidates if p in allowed]
    return candidates


def _definite_pointers(
    instrs: list[Instruction],
    taint: dict[str, frozenset[str]],
    module_vars: Mapping[str, str],
    candidates: list[str],
) -> set[str]:
    """Params that provably are global pointers: they flow into cvta.to.global."""
    definite: set[str] = set()
    for ins in instrs:
        if (
            ins.base == "cvta"
            and "to" in ins.parts
            and "global" in ins.parts
            and len(ins.operands) > 1
        ):
            definite |= operand_taint(ins.operands[1], taint, module_vars) & set(candidates)
    return definite


def _memory_accesses(
    module: PtxModule,
    entry: Entry,
    taint: dict[str, frozenset[str]],
    candidates: list[str],
    definite: set[str],
) -> tuple[list[MemoryAccess], list[Instruction], list[str]]:
    """Every global (or generic, not provably local/shared) access, the atomics, and the
    texture/surface instructions the transform refuses."""
    accesses: list[MemoryAccess] = []
    atomics: list[Instruction] = []
    unsupported: list[str] = []
    local_vars = named_variables(entry, module.module_vars)
    own_file = next((x.src_file for x in entry.instructions if x.src_file is not None), None)

    def located(access: MemoryAccess) -> MemoryAccess:
        number = access.instr.src_file
        if number is None or number == own_file or number not in module.files:
            return access
        return replace(access, src_file=module.files[number].rsplit("/", 1)[-1])

    for i, ins in enumerate(entry.instructions):
        base = ins.base
        if base in ("atom", "red"):
            atomics.append(ins)
        if base in ("tex", "tld4", "suld", "sust", "sured"):
            unsupported.append(f"texture/surface instruction at PTX line {ins.line} ({ins.opcode})")
            continue
        if ins.opcode.startswith("cp.async") and "global" in ins.parts:
            addrs = [o for o in ins.operands if o.startswith("[")]
            if len(addrs) >= 2:
                t = operand_taint(addrs[1], taint, local_vars)
                accesses.append(located(_make_access(i, ins, "read", t, candidates, definite)))
            continue
        if base not in _MEMORY_OPS:
            continue
        space = ins.state_space
        if space not in ("global", "generic"):
            continue
        addr = address_of(ins)
        if addr is None:
            continue
        t = operand_taint("[" + addr + "]", taint, local_vars)
        if space == "generic" and t and t <= {LOCAL, SHARED}:
            continue
        kind = "read" if base in ("ld", "ldu") else "write" if base == "st" else "atomic"
        accesses.append(located(_make_access(i, ins, kind, t, candidates, definite)))
    return accesses, atomics, unsupported


# (read, written) -> how a buffer is used.
_ACCESS_OF = {
    (True, True): Access.READ_WRITTEN,
    (False, True): Access.WRITTEN,
    (True, False): Access.READ,
    (False, False): Access.NONE,
}


def _accesses_to(param: str, accesses: list[MemoryAccess], kind: str) -> tuple[MemoryAccess, ...]:
    return tuple(a for a in accesses if param in a.params and a.kind == kind)


def _is_read(
    reads: tuple[MemoryAccess, ...],
    own: tuple[MemoryAccess, ...],
    atoms: tuple[MemoryAccess, ...],
) -> bool:
    """A load of a value another run could have left, or an atomic that reads (not an
    idempotent max/min/and/or, which counts as a plain write)."""
    rmw = [a for a in atoms if atomic_op(a.instr) in NON_IDEMPOTENT_ATOMICS]
    return len(reads) > len(own) or bool(rmw)


def _buffers(
    entry: Entry,
    candidates: list[str],
    accesses: list[MemoryAccess],
    definite: set[str],
    own_reads: frozenset[int] = frozenset(),
) -> dict[str, BufferUse]:
    """Per candidate that is used as a buffer: how it is accessed."""
    buffers: dict[str, BufferUse] = {}
    for p in candidates:
        reads = _accesses_to(p, accesses, "read")
        own = tuple(a for a in reads if a.index in own_reads)
        writes = _accesses_to(p, accesses, "write")
        atoms = _accesses_to(p, accesses, "atomic")
        if not (reads or writes or atoms) and p not in definite:
            continue  # a scalar that happens to be 64-bit (size_t n)
        access = _ACCESS_OF[(_is_read(reads, own, atoms), bool(writes or atoms))]
        buffers[p] = BufferUse(p, entry.display_name(p), access, reads, writes, atoms, own)
    return buffers


def _own_write_reads(
    entry: Entry, cfg: ControlFlow, accesses: list[MemoryAccess]
) -> frozenset[int]:
    """Instruction indices of the loads that read back what the same thread stored.

    A load counts when an unguarded store of the same width, state space and address
    operand comes before it on every path, with no new value of the address registers
    in between (``out[i] = 0; ... out[i] += v``): whatever a first run left there, a
    re-run overwrites it before it reads it.  Other threads' stores are the same run's,
    so they are no hazard either."""
    instrs = entry.instructions
    stores: dict[tuple[str, int, str | None], list[int]] = {}
    for a in accesses:
        if a.kind == "write" and a.instr.base == "st" and not a.instr.guard and a.params:
            addr = address_of(a.instr)
            if addr is not None:
                key = (addr, a.instr.access_width, a.instr.state_space)
                stores.setdefault(key, []).append(a.index)
    if not stores:
        return frozenset()
    defs: dict[str, list[int]] = {}
    for i, ins in enumerate(instrs):
        for reg in dests_and_sources(ins)[0]:
            defs.setdefault(reg, []).append(i)
    block_at = [0] * len(instrs)
    for b, (start, end) in enumerate(cfg.blocks):
        for i in range(start, end):
            block_at[i] = b
    covered: set[int] = set()
    for a in accesses:
        addr = address_of(a.instr) if a.kind == "read" else None
        if addr is None:
            continue
        for store in stores.get((addr, a.instr.access_width, a.instr.state_space), ()):
            starts = [-1, *(d for r in registers_in(addr) for d in defs.get(r, ()))]
            if not any(_reaches_avoiding(cfg, block_at, s, a.index, store) for s in starts):
                covered.add(a.index)
                break
    return frozenset(covered)


def _reaches_avoiding(
    cfg: ControlFlow, block_at: list[int], start: int, target: int, blocked: int
) -> bool:
    """Can control go from just after instruction ``start`` (-1: the kernel's start) to
    instruction ``target`` without passing instruction ``blocked``?"""

    def scan(block: int, first: int) -> bool | None:  # True: target; False: blocked
        for i in range(first, cfg.blocks[block][1]):
            if i == target:
                return True
            if i == blocked:
                return False
        return None

    first_block = 0 if start < 0 else block_at[start]
    outcome = scan(first_block, start + 1 if start >= 0 else 0)
    if outcome is not None:
        return outcome
    seen: set[int] = set()
    work = list(cfg.succ[first_block])
    while work:
        block = work.pop()
        if block in seen:
            continue
        seen.add(block)
        outcome = scan(block, cfg.blocks[block][0])
        if outcome is True:
            return True
        if outcome is None:
            work.extend(cfg.succ[block])
    return False


def _grid_sync(instrs: list[Instruction], cfg: ControlFlow) -> list[str]:
    """Reasons the kernel's blocks communicate: cluster barriers, cooperative-launch grid
    handles, spin loops on global memory."""
    grid_sync: list[str] = []
    for ins in instrs:
        if ins.base == "barrier" and "cluster" in ins.parts:
            grid_sync.append(f"cluster barrier at PTX line {ins.line} ({ins.opcode})")
        if any(o.startswith("%envreg") for o in ins.operands):
            grid_sync.append(
                f"reads {ins.operands[-1]} at PTX line {ins.line} (cooperative-launch grid handle)"
            )
    for (latch, header), body in cfg.loop_bodies.items():
        spin = _spin_load(instrs, cfg, body)
        if spin is not None:
            grid_sync.append(
                f"spin loop on global memory: {spin.opcode} at PTX line {spin.line} inside "
                f"the loop at PTX lines {instrs[cfg.blocks[header][0]].line}-"
                f"{instrs[cfg.blocks[latch][1] - 1].line} (waits on other blocks)"
            )
    return list(dict.fromkeys(grid_sync))


def _spin_load(instrs: list[Instruction], cfg: ControlFlow, body: Iterable[int]):
    """The first strong (volatile/acquire/relaxed) global load or CAS in a loop body."""
    for b in sorted(body):
        s, e = cfg.blocks[b]
        for ins in instrs[s:e]:
            strong = {"volatile", "acquire", "relaxed"} & set(ins.parts)
            if (
                ins.base in ("ld", "atom")
                and ins.state_space in ("global", "generic")
                and (strong or (ins.base == "atom" and "cas" in ins.parts))
            ):
                return ins
    return None


def _block_id_uses(
    module: PtxModule, instrs: list[Instruction]
) -> tuple[set[str], set[str], list[str]]:
    """Which of %ctaid/%nctaid x/y/z the kernel reads, and what the transform refuses
    about them: vector reads, cluster registers, and calls the analysis cannot step over
    (``callees.py``: a callee that touches memory, reads them, or has no body)."""
    uses_ctaid: set[str] = set()
    uses_nctaid: set[str] = set()
    unsupported: list[str] = []
    for ins in instrs:
        for op in ins.operands:
            if "%ctaid" in op or "%nctaid" in op:
                uses_ctaid |= {d for d in "xyz" if f"%ctaid.{d}" in op}
                uses_nctaid |= {d for d in "xyz" if f"%nctaid.{d}" in op}
                if op.strip() in ("%ctaid", "%nctaid"):
                    unsupported.append(f"vector read of {op} at PTX line {ins.line}")
            if "%cluster" in op or "%is_explicit_cluster" in op:
                unsupported.append(f"cluster register {op} at PTX line {ins.line}")
        if ins.base == "call":
            refusal = call_refusal(module, ins)
            if refusal:
                unsupported.append(refusal)
    return uses_ctaid, uses_nctaid, unsupported


def _make_access(i, ins, kind, t, candidates, definite) -> MemoryAccess:
    params = [p for p in candidates if p in t]
    sure = [p for p in params if p in definite]
    if len(params) > 1 and sure:
        params = sure
    sym = sorted(x for x in t if x.startswith(SYM))
    if params:
        origin = "param"
    elif sym:
        origin = "module-var:" + sym[0][len(SYM) :]
    elif LOADED in t:
        origin = "loaded"
    else:
        origin = "unknown"
    return MemoryAccess(i, ins, kind, tuple(params), origin)


def _early_exits(entry: Entry, cfg: ControlFlow, barriers: list[Instruction]):
    """Returns that are not the final one, and whether threads may return while others
    still wait at a barrier (the persistent transform cannot keep such kernels correct)."""
    early = _early_returns(entry.instructions, cfg)
    if early is None:
        return [], []
    if not barriers:
        return early, []
    return early, _return_barrier_hazards(entry, cfg)


def _early_returns(instrs: list[Instruction], cfg: ControlFlow) -> list[Instruction] | None:
    """Returns before the last one, and guarded branches to a block that only returns;
    None if the kernel never returns."""
    rets = [i for i, ins in enumerate(instrs) if ends_thread(ins) and ins.base != "trap"]
    if not rets:
        return None
    last_ret = rets[-1]
    early = [instrs[i] for i in rets if i != last_ret or instrs[i].guard]
    # Compilers merge returns: `if (i >= n) return;` becomes a guarded branch to a block
    # that only returns. Those branches are early exits too.
    ret_blocks = {
        b for b, (s, e) in enumerate(cfg.blocks) if ends_thread(instrs[s]) and not instrs[s].guard
    }
    labels_to_ret = {lab for lab, b in cfg.labels.items() if b in ret_blocks}
    early += [
        ins for ins in instrs
        if is_branch(ins) and ins.guard and ins.operands and ins.operands[0] in labels_to_ret
    ]  # fmt: skip
    return early


def _return_barrier_hazards(entry: Entry, cfg: ControlFlow) -> list[str]:
    """Branches on a thread-varying predicate where one way returns before any barrier
    and the other reaches one: some threads of a block would wait for ever."""
    instrs = entry.instructions
    has_bar = [any(_is_barrier(x) for x in instrs[s:e]) for s, e in cfg.blocks]
    has_ret = [any(ends_thread(x) for x in instrs[s:e]) for s, e in cfg.blocks]

    def reach(start: int, through_barriers: bool) -> set[int]:
        seen = {start}
        work = [start]
        while work:
            n = work.pop()
            if not through_barriers and has_bar[n]:
                continue
            for t in cfg.succ[n]:
                if t not in seen:
                    seen.add(t)
                    work.append(t)
        return seen

    def returns_first(start: int) -> bool:
        return any(has_ret[x] and not has_bar[x] for x in reach(start, False))

    def meets_barrier(start: int) -> bool:
        return any(has_bar[x] for x in reach(start, True))

    varying = varying_registers(entry)
    hazards: list[str] = []
    for b, (_, e) in enumerate(cfg.blocks):
        last = instrs[e - 1]
        if not (last.guard and len(cfg.succ[b]) == 2):
            continue
        if last.guard.lstrip("!") not in varying:
            continue  # every thread of the block takes the same way
        a, c = cfg.succ[b]
        bar_a, bar_c = meets_barrier(a), meets_barrier(c)
        if (returns_first(a) and bar_c and not bar_a) or (returns_first(c) and bar_a and not bar_c):
            hazards.append(
                f"threads may return early at the branch on PTX line {last.line} while others "
                "go on to a barrier"
            )
    return hazards


def analyse_module(
    module: PtxModule, *, pointer_params: Mapping[str, Iterable[str]] | None = None
) -> dict[str, KernelReport]:
    """Analyse every kernel entry of a module."""
    out = {}
    for e in module.entries:
        pp = pointer_params.get(e.name) if pointer_params else None
        out[e.name] = analyse_entry(module, e, pointer_params=pp)
    return out
