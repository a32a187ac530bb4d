"""What a kernel does to its buffers: control flow, def-use of pointer parameters, idempotence.

What it is for: given a parsed entry (``ptx.py``), build basic blocks and loops, follow
every pointer parameter from ``ld.param`` through ``cvta``/address arithmetic to the
``ld``/``st``/``atom``/``red`` instructions that touch global memory, and say per
parameter whether the kernel reads it, writes it, both, or cannot tell. From that it
classifies the kernel as *idempotent* (safe to kill and re-run), *non-idempotent* (needs
a snapshot of its write-set) or *unknown*, with reasons a user can read: which parameter,
which instruction, which PTX line. Aliasing is settled at launch from the actual
buffers (:func:`classify_launch`).

What it must not do: rewrite PTX or touch CUDA. It over-approximates where it must
(a write it cannot attribute makes the kernel *unknown*, never *idempotent*).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from gpushare_ext.kernels.ptx import Entry, Instruction, PtxModule

__all__ = [
    "Access",
    "BufferUse",
    "Classification",
    "ControlFlow",
    "Idempotence",
    "KernelReport",
    "MemoryAccess",
    "analyse_entry",
    "analyse_module",
    "classify_launch",
]

# Taint origins that are not parameters.
LOADED = "@loaded"  # a 64-bit value read from memory (a pointer loaded from memory)
LOCAL = "@local"  # a generic address into the stack / local depot
SHARED = "@shared"  # a generic address into shared memory
SYM = "@sym:"  # prefix: the address of a module-scope variable

_MEMORY_OPS = {"ld", "ldu", "st", "atom", "red"}
_NO_DEST = {
    "st", "red", "bar", "barrier", "bra", "ret", "exit", "membar", "fence", "prefetch",
    "prefetchu", "cp", "trap", "brkpt", "nanosleep", "pmevent", "griddepcontrol",
    "setmaxnreg", "stmatrix", "call", "discard", "applypriority", "st.async", "red.async",
    "multimem", "elect", "wgmma", "tcgen05", "cp.async",
}  # fmt: skip
_POINTER_PRESERVING = {"mov", "cvta", "cvt", "and", "or", "xor", "add", "sub", "selp", "min", "max"}
_VARYING_SPECIALS = ("%tid", "%laneid", "%warpid", "%smid", "%clock", "%globaltimer", "%lanemask")
_NON_IDEMPOTENT_ATOMICS = {"add", "inc", "dec", "cas", "exch", "sub"}


class Idempotence(str, Enum):
    IDEMPOTENT = "idempotent"
    NON_IDEMPOTENT = "non-idempotent"
    UNKNOWN = "unknown"


class Access(str, Enum):
    NONE = "none"
    READ = "read"
    WRITTEN = "written"
    READ_WRITTEN = "read-written"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class MemoryAccess:
    """One global-memory instruction and the parameters its address may come from."""

    index: int  # position in entry.instructions
    instr: Instruction
    kind: str  # "read" | "write" | "atomic"
    params: tuple[str, ...]  # candidate pointer parameters (empty: unattributed)
    origin: str  # "param" | "loaded" | "unknown" | "module-var:<name>"

    @property
    def where(self) -> str:
        src = f", source line {self.instr.src_line}" if self.instr.src_line else ""
        return f"PTX line {self.instr.line}{src} ({self.instr.opcode})"


@dataclass(frozen=True)
class BufferUse:
    """How the kernel uses one pointer parameter."""

    param: str
    display: str
    access: Access
    reads: tuple[MemoryAccess, ...] = ()
    writes: tuple[MemoryAccess, ...] = ()
    atomics: tuple[MemoryAccess, ...] = ()

    @property
    def is_written(self) -> bool:
        return bool(self.writes or self.atomics)


@dataclass(frozen=True)
class Classification:
    verdict: Idempotence
    reasons: tuple[str, ...]

    @property
    def idempotent(self) -> bool:
        return self.verdict is Idempotence.IDEMPOTENT


@dataclass
class ControlFlow:
    """Basic blocks over ``entry.instructions`` (index ranges), edges and loops."""

    blocks: list[tuple[int, int]]  # [start, end) instruction indices
    labels: dict[str, int]  # label -> block index
    succ: list[list[int]]
    back_edges: list[tuple[int, int]]  # (latch block, header block)
    loop_bodies: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)

    def block_of(self, index: int) -> int:
        for b, (s, e) in enumerate(self.blocks):
            if s <= index < e:
                return b
        raise IndexError(index)


@dataclass
class KernelReport:
    """Everything the analysis found about one entry."""

    entry: Entry
    cfg: ControlFlow
    buffers: dict[str, BufferUse]  # pointer params only, in parameter order
    accesses: list[MemoryAccess]
    classification: Classification
    atomics: list[Instruction]
    barriers: list[Instruction]
    grid_sync: list[str]  # reasons (empty: none found)
    loaded_pointers: list[MemoryAccess]
    early_exits: list[Instruction]
    early_exit_hazards: list[str]
    uses_ctaid: frozenset[str]  # subset of {"x","y","z"}
    uses_nctaid: frozenset[str]
    unsupported: list[str]  # things the transform refuses (cluster registers, calls...)
    taint: dict[str, frozenset[str]]

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def resumable(self) -> bool:
        """Blocks are independent: resume from the counter is sound."""
        return not self.grid_sync

    @property
    def loops(self) -> list[tuple[int, int]]:
        return self.cfg.back_edges

    @property
    def pointer_params(self) -> list[str]:
        return list(self.buffers)

    @property
    def write_set(self) -> list[str]:
        return [p for p, b in self.buffers.items() if b.is_written]

    def describe(self) -> str:
        c = self.classification
        lines = [f"{self.name}: {c.verdict.value}"]
        lines += [f"  - {r}" for r in c.reasons]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Control flow
# ---------------------------------------------------------------------------------------


def _is_branch(ins: Instruction) -> bool:
    return ins.base in ("bra", "brx")


def _ends_thread(ins: Instruction) -> bool:
    return ins.base in ("ret", "exit", "trap")


def build_cfg(entry: Entry) -> ControlFlow:
    instrs = entry.instructions
    # Block leaders: first instruction, each labelled instruction, each after a branch/ret.
    label_at: dict[str, int] = {}
    idx = 0
    pending: list[str] = []
    for s in entry.body:
        if s.kind == "label":
            pending.append(s.text)
        elif s.kind == "instr":
            for lab in pending:
                label_at[lab] = idx
            pending = []
            idx += 1
    for lab in pending:
        label_at[lab] = idx  # label at the very end
    leaders = {0, *label_at.values()}
    for i, ins in enumerate(instrs):
        if _is_branch(ins) or _ends_thread(ins):
            leaders.add(i + 1)
    starts = sorted(x for x in leaders if x <= len(instrs))
    if not instrs:
        return ControlFlow([], {}, [], [])
    blocks = [(s, e) for s, e in zip(starts, [*starts[1:], len(instrs)], strict=True) if s < e]
    start_to_block = {s: b for b, (s, _) in enumerate(blocks)}
    labels = {lab: start_to_block[i] for lab, i in label_at.items() if i in start_to_block}
    succ: list[list[int]] = []
    for b, (_s, e) in enumerate(blocks):
        last = instrs[e - 1]
        out: list[int] = []
        if _is_branch(last):
            target = last.operands[0] if last.operands else ""
            if target in labels:
                out.append(labels[target])
            if last.guard and b + 1 < len(blocks):
                out.append(b + 1)
        elif _ends_thread(last):
            if last.guard and b + 1 < len(blocks):
                out.append(b + 1)
        elif b + 1 < len(blocks):
            out.append(b + 1)
        succ.append(out)
    # Back edges by iterative DFS from the entry block.
    back: list[tuple[int, int]] = []
    state = [0] * len(blocks)  # 0 new, 1 on stack, 2 done
    stack: list[tuple[int, int]] = [(0, 0)]
    state[0] = 1
    while stack:
        node, k = stack.pop()
        if k < len(succ[node]):
            stack.append((node, k + 1))
            nxt = succ[node][k]
            if state[nxt] == 1:
                back.append((node, nxt))
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, 0))
        else:
            state[node] = 2
    preds: list[list[int]] = [[] for _ in blocks]
    for b, out in enumerate(succ):
        for t in out:
            preds[t].append(b)
    bodies: dict[tuple[int, int], frozenset[int]] = {}
    for latch, header in back:
        body = {header, latch}
        work = [latch] if latch != header else []  # never expand through the header
        while work:
            n = work.pop()
            for p in preds[n]:
                if p not in body:
                    body.add(p)
                    work.append(p)
        bodies[(latch, header)] = frozenset(body)
    return ControlFlow(blocks, labels, succ, back, bodies)


# ---------------------------------------------------------------------------------------
# Def-use of pointer parameters
# ---------------------------------------------------------------------------------------


def _regs_in(operand: str) -> list[str]:
    """Registers named in an operand (``%rd1``, ``{%r1, %r2}``, ``[%rd3+4]``)."""
    out = []
    token = ""
    for ch in operand + " ":
        if ch == "%" and not token:
            token = "%"
        elif token and (ch.isalnum() or ch in "_$"):
            token += ch
        else:
            if token and token != "%":
                out.append(token)
            token = "%" if ch == "%" else ""
    return out


def _address(ins: Instruction) -> str | None:
    for op in ins.operands:
        if op.startswith("["):
            return op[1:-1].strip()
    return None


def _param_slot(addr: str) -> str:
    """The parameter an ``ld.param`` reads: ``x``, or ``s@8`` for the 64-bit field at byte
    8 of a by-value struct ``s`` (CuPy passes each array as such a struct)."""
    base = _address_base(addr)
    rest = addr.strip()[len(base) :].replace(" ", "")
    if rest.startswith("+") and rest[1:].isdigit():
        return f"{base}@{int(rest[1:])}"
    return base


def struct_pointer_fields(entry: Entry) -> list[str]:
    """``s@offset`` for every 8-byte-aligned 64-bit field a kernel loads from a by-value
    struct parameter: each may be a pointer (a CuPy array's data), the analysis decides."""
    structs = {p.name for p in entry.params if p.array is not None}
    fields: list[str] = []
    for ins in entry.instructions:
        if ins.base != "ld" or ins.state_space != "param" or not ins.is_64bit:
            continue
        addr = _address(ins) or ""
        base = _address_base(addr)
        if base not in structs:
            continue
        offset = int(_param_slot(addr).partition("@")[2] or 0)
        field = f"{base}@{offset}"
        if offset % 8 == 0 and field not in fields:
            fields.append(field)
    return fields


def _address_base(addr: str) -> str:
    base = addr
    for sep in ("+", "-"):
        if sep in base[1:]:
            base = base[: base.index(sep, 1)]
    return base.strip()


def _dests_and_sources(ins: Instruction) -> tuple[list[str], list[str]]:
    base = ins.base
    ops = list(ins.operands)
    if base in _NO_DEST or ins.opcode.startswith(tuple(_NO_DEST)) or not ops:
        return [], [r for o in ops for r in _regs_in(o)]
    dest = ops[0]
    dests = [r for part in dest.split("|") for r in _regs_in(part)]
    return dests, [r for o in ops[1:] for r in _regs_in(o)]


def _operand_taint(op: str, taint: Mapping[str, frozenset[str]], mod_vars: Mapping[str, str]):
    regs = _regs_in(op)
    out: set[str] = set()
    for r in regs:
        if r in ("%SP", "%SPL"):
            out.add(LOCAL)
        out |= taint.get(r, frozenset())
    name = op.strip("[] ")
    name = _address_base(name) if name else name
    if name.startswith("__local_depot"):
        out.add(LOCAL)
    elif name in mod_vars:
        out.add(SHARED if mod_vars[name] == "shared" else SYM + name)
    return out


def compute_taint(
    entry: Entry, pointer_params: Iterable[str], mod_vars: Mapping[str, str]
) -> dict[str, frozenset[str]]:
    """Flow-insensitive fixpoint: register -> origins (param names, LOADED, LOCAL, ...)."""
    ptrs = set(pointer_params)
    taint: dict[str, frozenset[str]] = {}
    instrs = entry.instructions
    shared_decls = {
        s.text.split()[-1].split("[")[0]
        for s in entry.body
        if s.kind == "decl" and ".shared" in s.text
    }
    local_vars = {**mod_vars, **dict.fromkeys(shared_decls, "shared")}
    changed = True
    while changed:
        changed = False
        for ins in instrs:
            dests, _ = _dests_and_sources(ins)
            if not dests:
                continue
            new: set[str] = set()
            base = ins.base
            ops = ins.operands
            if base in ("ld", "ldu"):
                space = ins.state_space
                addr = _address(ins) or ""
                if space == "param":
                    pname = _param_slot(addr)
                    if pname not in ptrs and f"{pname}@0" in ptrs:
                        pname = f"{pname}@0"  # a struct's first field
                    if pname in ptrs:
                        new.add(pname)
                elif ins.is_64bit and space in ("global", "generic", "local", "const"):
                    new.add(LOADED)
            elif base == "atom":
                if ins.is_64bit:
                    new.add(LOADED)
            elif base == "cvta":
                if "local" in ins.parts:
                    new.add(LOCAL)
                elif "shared" in ins.parts[1:] and "to" not in ins.parts:
                    new.add(SHARED)
                else:
                    new |= _operand_taint(ops[1], taint, local_vars) if len(ops) > 1 else set()
            elif base in ("mad", "fma"):
                if len(ops) >= 4:
                    new |= _operand_taint(ops[3], taint, local_vars)
            elif base == "sub":
                if len(ops) >= 2:
                    new |= _operand_taint(ops[1], taint, local_vars)
            elif base == "selp":
                for o in ops[1:3]:
                    new |= _operand_taint(o, taint, local_vars)
            elif base in _POINTER_PRESERVING:
                for o in ops[1:]:
                    new |= _operand_taint(o, taint, local_vars)
            if not new:
                continue
            for d in dests:
                old = taint.get(d, frozenset())
                if not new <= old:
                    taint[d] = old | new
                    changed = True
    return taint


def _varying_registers(entry: Entry) -> set[str]:
    """Registers whose value may differ between threads of a block (flow-insensitive)."""
    varying: set[str] = set()
    changed = True
    instrs = entry.instructions
    while changed:
        changed = False
        for ins in instrs:
            dests, srcs = _dests_and_sources(ins)
            if not dests:
                continue
            v = any(s in varying for s in srcs)
            v = v or any(o.startswith(_VARYING_SPECIALS) for o in ins.operands[1:])
            v = v or (ins.base in ("ld", "ldu") and ins.state_space not in ("param", "const"))
            v = v or ins.base in ("atom", "shfl", "vote", "match", "activemask", "redux")
            if v:
                for d in dests:
                    if d not in varying:
                        varying.add(d)
                        changed = True
    return varying


# ---------------------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------------------


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
    """Analyse one entry. ``pointer_params`` narrows which params are buffers (Numba ABI)."""
    cfg = build_cfg(entry)
    instrs = entry.instructions
    candidates = [p.name for p in entry.params if p.may_be_pointer]
    candidates += struct_pointer_fields(entry)
    if pointer_params is not None:
        allowed = set(pointer_params)
        candidates = [p for p in candidates if p in allowed]
    taint = compute_taint(entry, candidates, module.module_vars)

    # Params that provably are global pointers: they flow into cvta.to.global.
    definite: set[str] = set()
    for ins in instrs:
        if (
            ins.base == "cvta"
            and "to" in ins.parts
            and "global" in ins.parts
            and len(ins.operands) > 1
        ):
            definite |= _operand_taint(ins.operands[1], taint, module.module_vars) & set(candidates)

    accesses: list[MemoryAccess] = []
    atomics: list[Instruction] = []
    unsupported: list[str] = []
    shared_decls = {
        s.text.split()[-1].split("[")[0]
        for s in entry.body
        if s.kind == "decl" and ".shared" in s.text
    }
    local_vars = {**module.module_vars, **dict.fromkeys(shared_decls, "shared")}
    for i, ins in enumerate(instrs):
        base = ins.base
        if base in ("atom", "red"):
            atomics.append(ins)
        if base in ("tex", "tld4", "suld", "sust", "sured"):
            unsupported.append(f"texture/surface instruction at PTX line {ins.line} ({ins.opcode})")
            continue
        if ins.opcode.startswith("cp.async") and "global" in ins.parts:
            addrs = [o for o in ins.operands if o.startswith("[")]
            if len(addrs) >= 2:
                t = _operand_taint(addrs[1], taint, local_vars)
                accesses.append(_make_access(i, ins, "read", t, candidates, definite))
            continue
        if base not in _MEMORY_OPS:
            continue
        space = ins.state_space
        if space not in ("global", "generic"):
            continue
        addr = _address(ins)
        if addr is None:
            continue
        t = _operand_taint("[" + addr + "]", taint, local_vars)
        if space == "generic" and t and t <= {LOCAL, SHARED}:
            continue
        kind = "read" if base in ("ld", "ldu") else "write" if base == "st" else "atomic"
        accesses.append(_make_access(i, ins, kind, t, candidates, definite))

    buffers: dict[str, BufferUse] = {}
    for p in candidates:
        reads = tuple(a for a in accesses if p in a.params and a.kind == "read")
        writes = tuple(a for a in accesses if p in a.params and a.kind == "write")
        atoms = tuple(a for a in accesses if p in a.params and a.kind == "atomic")
        if not (reads or writes or atoms) and p not in definite:
            continue  # a scalar that happens to be 64-bit (size_t n)
        # An idempotent atomic (max/min/and/or) counts as a plain write; others read too.
        rmw = [a for a in atoms if _atomic_op(a.instr) in _NON_IDEMPOTENT_ATOMICS]
        read = bool(reads or rmw)
        written = bool(writes or atoms)
        access = (
            Access.READ_WRITTEN if read and written
            else Access.WRITTEN if written
            else Access.READ if read
            else Access.NONE
        )  # fmt: skip
        buffers[p] = BufferUse(p, entry.display_name(p), access, reads, writes, atoms)

    loaded = [a for a in accesses if a.origin == "loaded"]
    # Barriers, grid sync, spin loops.
    barriers = [ins for ins in instrs if _is_barrier(ins)]
    grid_sync: list[str] = []
    for ins in instrs:
        if ins.base == "barrier" and "cluster" in ins.parts:
            grid_sync.append(f"cluster barrier at PTX line {ins.line} ({ins.opcode})")
        if any(o.startswith("%envreg") for o in ins.operands):
            grid_sync.append(
                f"reads {ins.operands[-1]} at PTX line {ins.line} (cooperative-launch grid handle)"
            )
    for (latch, header), body in cfg.loop_bodies.items():
        for b in sorted(body):
            s, e = cfg.blocks[b]
            for ins in instrs[s:e]:
                strong = {"volatile", "acquire", "relaxed"} & set(ins.parts)
                if (
                    ins.base in ("ld", "atom")
                    and ins.state_space in ("global", "generic")
                    and (strong or (ins.base == "atom" and "cas" in ins.parts))
                ):
                    grid_sync.append(
                        f"spin loop on global memory: {ins.opcode} at PTX line {ins.line} inside "
                        f"the loop at PTX lines {instrs[cfg.blocks[header][0]].line}-"
                        f"{instrs[cfg.blocks[latch][1] - 1].line} (waits on other blocks)"
                    )
                    break
    grid_sync = list(dict.fromkeys(grid_sync))

    uses_ctaid: set[str] = set()
    uses_nctaid: set[str] = set()
    for ins in instrs:
        for op in ins.operands:
            if "%ctaid" in op or "%nctaid" in op:
                for dim in ("x", "y", "z"):
                    if f"%ctaid.{dim}" in op:
                        uses_ctaid.add(dim)
                    if f"%nctaid.{dim}" in op:
                        uses_nctaid.add(dim)
                if op.strip() in ("%ctaid", "%nctaid"):
                    unsupported.append(f"vector read of {op} at PTX line {ins.line}")
            if "%cluster" in op or "%is_explicit_cluster" in op:
                unsupported.append(f"cluster register {op} at PTX line {ins.line}")
        if ins.base == "call":
            callee = ins.operands[1] if len(ins.operands) > 1 else ""
            callee = (
                callee if not callee.startswith("(") else (ins.operands[0] if ins.operands else "")
            )
            if not any(fn.name == callee for fn in module.functions) and callee == "vprintf":
                continue
            fn = next((f for f in module.functions if f.name == callee), None)
            if fn is None or any(
                "%ctaid" in o or "%nctaid" in o for x in fn.instructions for o in x.operands
            ):
                unsupported.append(
                    f"call to {callee or 'a function'} at PTX line {ins.line}: device functions "
                    "are not instrumented (inline them)"
                )
    early_exits, hazards = _early_exits(entry, cfg, barriers)

    report = KernelReport(
        entry=entry,
        cfg=cfg,
        buffers=buffers,
        accesses=accesses,
        classification=Classification(Idempotence.UNKNOWN, ()),
        atomics=atomics,
        barriers=barriers,
        grid_sync=grid_sync,
        loaded_pointers=loaded,
        early_exits=early_exits,
        early_exit_hazards=hazards,
        uses_ctaid=frozenset(uses_ctaid),
        uses_nctaid=frozenset(uses_nctaid),
        unsupported=list(dict.fromkeys(unsupported)),
        taint=taint,
    )
    report.classification = _classify(report, module)
    return report


def _atomic_op(ins: Instruction) -> str:
    for p in ins.parts[1:]:
        if p in ("add", "inc", "dec", "cas", "exch", "sub", "max", "min", "and", "or", "xor"):
            return p
    return "?"


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
    instrs = entry.instructions
    rets = [i for i, ins in enumerate(instrs) if _ends_thread(ins) and ins.base != "trap"]
    if not rets:
        return [], []
    last_ret = rets[-1]
    early = [instrs[i] for i in rets if i != last_ret or instrs[i].guard]
    # Compilers merge returns: `if (i >= n) return;` becomes a guarded branch to a block
    # that only returns. Those branches are early exits too.
    ret_blocks = {
        b for b, (s, e) in enumerate(cfg.blocks) if _ends_thread(instrs[s]) and not instrs[s].guard
    }
    labels_to_ret = {lab for lab, b in cfg.labels.items() if b in ret_blocks}
    early += [
        ins for ins in instrs
        if _is_branch(ins) and ins.guard and ins.operands and ins.operands[0] in labels_to_ret
    ]  # fmt: skip
    if not barriers:
        return early, []
    nb = len(cfg.blocks)
    has_bar = [any(_is_barrier(x) for x in instrs[s:e]) for s, e in cfg.blocks]
    has_ret = [any(_ends_thread(x) for x in instrs[s:e]) for s, e in cfg.blocks]

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

    varying = _varying_registers(entry)
    hazards: list[str] = []
    for b in range(nb):
        _, e = cfg.blocks[b]
        last = instrs[e - 1]
        if not (last.guard and len(cfg.succ[b]) == 2):
            continue
        if last.guard.lstrip("!") not in varying:
            continue  # every thread of the block takes the same way
        a, c = cfg.succ[b]
        ret_a = any(has_ret[x] and not has_bar[x] for x in reach(a, False))
        ret_c = any(has_ret[x] and not has_bar[x] for x in reach(c, False))
        bar_a = any(has_bar[x] for x in reach(a, True))
        bar_c = any(has_bar[x] for x in reach(c, True))
        if (ret_a and bar_c and not bar_a) or (ret_c and bar_a and not bar_c):
            hazards.append(
                f"threads may return early at the branch on PTX line {last.line} while others "
                "go on to a barrier"
            )
    return early, hazards


def _classify(report: KernelReport, module: PtxModule) -> Classification:
    unknown: list[str] = []
    non: list[str] = []
    for a in report.accesses:
        if a.origin == "loaded":
            unknown.append(
                f"{a.kind} through a pointer loaded from memory at {a.where}: its buffer is "
                "not a parameter"
            )
        elif a.origin == "unknown":
            unknown.append(f"{a.kind} at {a.where} whose address the analysis cannot attribute")
        elif a.origin.startswith("module-var:") and a.kind != "read":
            unknown.append(
                f"{a.kind} to the module variable {a.origin.split(':', 1)[1]} at {a.where}"
            )
    unknown += report.unsupported
    for b in report.buffers.values():
        name = f"`{b.display}`"
        if b.access is Access.READ_WRITTEN:
            if b.reads and (b.writes or b.atomics):
                w = (b.writes or b.atomics)[0]
                non.append(
                    f"parameter {name} is read ({b.reads[0].where}) and written ({w.where}): "
                    "a re-run would read values the first run already overwrote"
                )
            for a in b.atomics:
                op = _atomic_op(a.instr)
                if op in _NON_IDEMPOTENT_ATOMICS:
                    non.append(
                        f"atomic {op} on parameter {name} at {a.where} reads and updates it: "
                        "a re-run would apply it twice"
                    )
                    break
    if report.grid_sync:
        non.append("blocks communicate (" + "; ".join(report.grid_sync[:2]) + ")")
    if unknown:
        return Classification(Idempotence.UNKNOWN, tuple(dict.fromkeys(unknown + non)))
    if non:
        return Classification(Idempotence.NON_IDEMPOTENT, tuple(dict.fromkeys(non)))
    reasons = []
    for b in report.buffers.values():
        if b.access is Access.READ:
            reasons.append(f"parameter `{b.display}` is only read")
        elif b.access is Access.WRITTEN:
            how = " (replay-safe atomics)" if b.atomics and not b.writes else ""
            reasons.append(f"parameter `{b.display}` is only written{how}")
    if not reasons:
        reasons.append("the kernel touches no global memory through its parameters")
    return Classification(Idempotence.IDEMPOTENT, tuple(reasons))


def analyse_module(
    module: PtxModule, *, pointer_params: Mapping[str, Iterable[str]] | None = None
) -> dict[str, KernelReport]:
    """Analyse every kernel entry of a module."""
    out = {}
    for e in module.entries:
        pp = pointer_params.get(e.name) if pointer_params else None
        out[e.name] = analyse_entry(module, e, pointer_params=pp)
    return out


# ---------------------------------------------------------------------------------------
# Launch-time aliasing
# ---------------------------------------------------------------------------------------


def classify_launch(report: KernelReport, extents: Mapping[str, tuple[int, int]]) -> Classification:
    """Re-classify with the actual buffers: ``extents`` maps param -> (address, nbytes).

    Two parameters whose extents overlap are one buffer: if one is read and the other is
    written, the kernel is not idempotent for this launch.
    """
    base = report.classification
    if base.verdict is not Idempotence.IDEMPOTENT:
        return base
    uses = [
        b for b in report.buffers.values() if b.param in extents and b.access is not Access.NONE
    ]
    reasons: list[str] = []
    for i, a in enumerate(uses):
        for b in uses[i + 1 :]:
            pa, na = extents[a.param]
            pb, nb = extents[b.param]
            if na == 0 or nb == 0 or pa + na <= pb or pb + nb <= pa:
                continue
            reader = a if a.access is Access.READ else b if b.access is Access.READ else None
            writer = b if reader is a else a if reader is b else None
            if reader is not None and writer is not None and writer.is_written:
                reasons.append(
                    f"parameters `{reader.display}` and `{writer.display}` overlap in memory: "
                    f"`{reader.display}` is read and `{writer.display}` is written, so this "
                    "launch updates a buffer in place"
                )
            elif a.is_written and b.is_written:
                reasons.append(
                    f"parameters `{a.display}` and `{b.display}` overlap in memory and both "
                    "are written"
                )
    if reasons:
        return Classification(Idempotence.NON_IDEMPOTENT, tuple(reasons))
    return base
