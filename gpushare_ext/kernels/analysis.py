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
from dataclasses import dataclass, field, replace
from enum import Enum

from gpushare_ext.kernels.ptx import Entry, Instruction, PtxModule
from gpushare_ext.kernels.signatures import kernel_name

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
    src_file: str = ""  # the source file's name, where it is not the kernel's own

    @property
    def where(self) -> str:
        ins = self.instr
        if not ins.src_line:
            return f"PTX line {ins.line} ({ins.opcode})"
        of = f" of {self.src_file}" if self.src_file else ""
        return f"source line {ins.src_line}{of} (PTX line {ins.line}, {ins.opcode})"


@dataclass(frozen=True)
class BufferUse:
    """How the kernel uses one pointer parameter."""

    param: str
    display: str
    access: Access
    reads: tuple[MemoryAccess, ...] = ()
    writes: tuple[MemoryAccess, ...] = ()
    atomics: tuple[MemoryAccess, ...] = ()
    # Reads of what the same thread stored at the same address earlier in the run: a
    # re-run reads its own value there, never the first run's, so they are no hazard.
    own_reads: tuple[MemoryAccess, ...] = ()

    @property
    def is_written(self) -> bool:
        return bool(self.writes or self.atomics)

    @property
    def hazard_reads(self) -> tuple[MemoryAccess, ...]:
        """Reads that may see a value an earlier run of the kernel left."""
        own = {a.index for a in self.own_reads}
        return tuple(a for a in self.reads if a.index not in own)


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
    def display_name(self) -> str:
        """The C++ name (``scale<float>(float*, int)``), or the PTX name of a C kernel."""
        return kernel_name(self.entry.name)

    def summary(self) -> str:
        """One line: the name, the verdict and the reason that decided it first."""
        c = self.classification
        line = f"{self.display_name}: {c.verdict.value}"
        if c.verdict is Idempotence.IDEMPOTENT and self.buffers:
            return f"{line}: no buffer is both read and written ({self._buffer_roles()})"
        if c.reasons:
            line += f": {c.reasons[0]}"
            if len(c.reasons) > 1:
                more = len(c.reasons) - 1
                line += f" (and {more} more reason{'s' if more != 1 else ''})"
        return line

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

    def _buffer_roles(self) -> str:
        def names(bs: list[BufferUse]) -> str:
            return ", ".join(f"`{b.display}`" for b in bs)

        written = [b for b in self.buffers.values() if b.access is Access.WRITTEN]
        read = [b for b in self.buffers.values() if b.access is Access.READ]
        parts = []
        if written:
            back = [b for b in written if b.own_reads]
            note = f", {names(back)} read back only where written" if back else ""
            parts.append(f"written: {names(written)}{note}")
        if read:
            parts.append(f"read: {names(read)}")
        return "; ".join(parts) or "none is used"

    def describe(self) -> str:
        c = self.classification
        lines = [f"{self.display_name}: {c.verdict.value}"]
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
    """Basic blocks, successors, back edges (loops) and loop bodies of one entry."""
    instrs = entry.instructions
    if not instrs:
        return ControlFlow([], {}, [], [])
    label_at = _label_positions(entry)
    blocks = _basic_blocks(instrs, label_at)
    start_to_block = {s: b for b, (s, _) in enumerate(blocks)}
    labels = {lab: start_to_block[i] for lab, i in label_at.items() if i in start_to_block}
    succ = [_successors(instrs, blocks, labels, b) for b in range(len(blocks))]
    back = _back_edges(succ)
    return ControlFlow(blocks, labels, succ, back, _loop_bodies(succ, back))


def _label_positions(entry: Entry) -> dict[str, int]:
    """Label -> index of the instruction it stands before (the end for a final label)."""
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
    return label_at


def _basic_blocks(instrs: list[Instruction], label_at: dict[str, int]) -> list[tuple[int, int]]:
    """(start, end) of each block. Leaders: the first instruction, each labelled one, and
    each one after a branch or a return."""
    leaders = {0, *label_at.values()}
    for i, ins in enumerate(instrs):
        if _is_branch(ins) or _ends_thread(ins):
            leaders.add(i + 1)
    starts = sorted(x for x in leaders if x <= len(instrs))
    return [(s, e) for s, e in zip(starts, [*starts[1:], len(instrs)], strict=True) if s < e]


def _successors(
    instrs: list[Instruction], blocks: list[tuple[int, int]], labels: dict[str, int], b: int
) -> list[int]:
    last = instrs[blocks[b][1] - 1]
    falls_through = b + 1 < len(blocks)
    if _is_branch(last):
        target = last.operands[0] if last.operands else ""
        out = [labels[target]] if target in labels else []
        return out + ([b + 1] if last.guard and falls_through else [])
    if _ends_thread(last):
        return [b + 1] if last.guard and falls_through else []
    return [b + 1] if falls_through else []


def _back_edges(succ: list[list[int]]) -> list[tuple[int, int]]:
    """(latch, header) pairs, by an iterative depth-first search from the entry block."""
    back: list[tuple[int, int]] = []
    state = [0] * len(succ)  # 0 new, 1 on stack, 2 done
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
    return back


def _loop_bodies(
    succ: list[list[int]], back: list[tuple[int, int]]
) -> dict[tuple[int, int], frozenset[int]]:
    """The blocks of each natural loop: what reaches the latch without passing the header."""
    preds: list[list[int]] = [[] for _ in succ]
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
    return bodies


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
    order = {p.name: i for i, p in enumerate(entry.params)}
    return sorted(fields, key=lambda f: (order[f.partition("@")[0]], int(f.partition("@")[2])))


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
    local_vars = _local_vars(entry, mod_vars)
    changed = True
    while changed:
        changed = False
        for ins in entry.instructions:
            dests, _ = _dests_and_sources(ins)
            new = _origins(ins, taint, ptrs, local_vars) if dests else set()
            for d in dests if new else ():
                old = taint.get(d, frozenset())
                if not new <= old:
                    taint[d] = old | new
                    changed = True
    return taint


def _local_vars(entry: Entry, mod_vars: Mapping[str, str]) -> dict[str, str]:
    """Module variables and the entry's own ``.shared`` declarations, by name."""
    shared_decls = {
        s.text.split()[-1].split("[")[0]
        for s in entry.body
        if s.kind == "decl" and ".shared" in s.text
    }
    return {**mod_vars, **dict.fromkeys(shared_decls, "shared")}


def _origins(
    ins: Instruction,
    taint: Mapping[str, frozenset[str]],
    ptrs: set[str],
    local_vars: Mapping[str, str],
) -> set[str]:
    """Where the value ``ins`` writes may come from, given the taint known so far."""
    base, ops = ins.base, ins.operands
    if base in ("ld", "ldu"):
        space = ins.state_space
        if space == "param":
            pname = _param_slot(_address(ins) or "")
            if pname not in ptrs and f"{pname}@0" in ptrs:
                pname = f"{pname}@0"  # a struct's first field
            return {pname} if pname in ptrs else set()
        wide = ins.is_64bit and space in ("global", "generic", "local", "const")
        return {LOADED} if wide else set()
    if base == "atom":
        return {LOADED} if ins.is_64bit else set()
    if base == "cvta":
        if "local" in ins.parts:
            return {LOCAL}
        if "shared" in ins.parts[1:] and "to" not in ins.parts:
            return {SHARED}
        sources = ops[1:2]
    elif base in ("mad", "fma"):
        sources = ops[3:4]  # the addend; the product is an offset
    elif base == "sub":
        sources = ops[1:2]
    elif base == "selp":
        sources = ops[1:3]
    elif base in _POINTER_PRESERVING:
        sources = ops[1:]
    else:
        return set()
    out: set[str] = set()
    for o in sources:
        out |= _operand_taint(o, taint, local_vars)
    return out


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
    """Analyse one entry. ``pointer_params`` narrows which params are buffers (Numba ABI).

    The steps, each a function below: control flow, candidate pointers, taint, the
    definite pointers, memory accesses, buffers, grid-wide synchronisation, block-id
    uses, early exits, then the classification.
    """
    cfg = build_cfg(entry)
    instrs = entry.instructions
    candidates = _candidate_pointers(entry, pointer_params)
    taint = compute_taint(entry, candidates, module.module_vars)
    definite = _definite_pointers(instrs, taint, module.module_vars, candidates)
    accesses, atomics, unsupported = _memory_accesses(module, entry, taint, candidates, definite)
    buffers = _buffers(
        entry, candidates, accesses, definite, _own_write_reads(entry, cfg, accesses)
    )
    barriers = [ins for ins in instrs if _is_barrier(ins)]
    uses_ctaid, uses_nctaid, refused = _block_id_uses(module, instrs)
    early_exits, hazards = _early_exits(entry, cfg, barriers)
    report = KernelReport(
        entry=entry,
        cfg=cfg,
        buffers=buffers,
        accesses=accesses,
        classification=Classification(Idempotence.UNKNOWN, ()),
        atomics=atomics,
        barriers=barriers,
        grid_sync=_grid_sync(instrs, cfg),
        loaded_pointers=[a for a in accesses if a.origin == "loaded"],
        early_exits=early_exits,
        early_exit_hazards=hazards,
        uses_ctaid=frozenset(uses_ctaid),
        uses_nctaid=frozenset(uses_nctaid),
        unsupported=list(dict.fromkeys(unsupported + refused)),
        taint=taint,
    )
    report.classification = _classify(report, module)
    return report


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
            definite |= _operand_taint(ins.operands[1], taint, module_vars) & set(candidates)
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
    local_vars = _local_vars(entry, module.module_vars)
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
                t = _operand_taint(addrs[1], taint, local_vars)
                accesses.append(located(_make_access(i, ins, "read", t, candidates, definite)))
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
        accesses.append(located(_make_access(i, ins, kind, t, candidates, definite)))
    return accesses, atomics, unsupported


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
        reads = tuple(a for a in accesses if p in a.params and a.kind == "read")
        own = tuple(a for a in reads if a.index in own_reads)
        writes = tuple(a for a in accesses if p in a.params and a.kind == "write")
        atoms = tuple(a for a in accesses if p in a.params and a.kind == "atomic")
        if not (reads or writes or atoms) and p not in definite:
            continue  # a scalar that happens to be 64-bit (size_t n)
        # An idempotent atomic (max/min/and/or) counts as a plain write; others read too.
        rmw = [a for a in atoms if _atomic_op(a.instr) in _NON_IDEMPOTENT_ATOMICS]
        read = len(reads) > len(own) or bool(rmw)
        written = bool(writes or atoms)
        access = (
            Access.READ_WRITTEN if read and written
            else Access.WRITTEN if written
            else Access.READ if read
            else Access.NONE
        )  # fmt: skip
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
            addr = _address(a.instr)
            if addr is not None:
                key = (addr, a.instr.access_width, a.instr.state_space)
                stores.setdefault(key, []).append(a.index)
    if not stores:
        return frozenset()
    defs: dict[str, list[int]] = {}
    for i, ins in enumerate(instrs):
        for reg in _dests_and_sources(ins)[0]:
            defs.setdefault(reg, []).append(i)
    block_at = [0] * len(instrs)
    for b, (start, end) in enumerate(cfg.blocks):
        for i in range(start, end):
            block_at[i] = b
    covered: set[int] = set()
    for a in accesses:
        addr = _address(a.instr) if a.kind == "read" else None
        if addr is None:
            continue
        for store in stores.get((addr, a.instr.access_width, a.instr.state_space), ()):
            starts = [-1, *(d for r in _regs_in(addr) for d in defs.get(r, ()))]
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
    about them: vector reads, cluster registers, calls to functions that read them."""
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
            refusal = _call_refusal(module, ins)
            if refusal:
                unsupported.append(refusal)
    return uses_ctaid, uses_nctaid, unsupported


def _call_refusal(module: PtxModule, ins: Instruction) -> str | None:
    """Why a call keeps the kernel from being transformed, or None (vprintf is fine)."""
    callee = ins.operands[1] if len(ins.operands) > 1 else ""
    callee = callee if not callee.startswith("(") else (ins.operands[0] if ins.operands else "")
    if not any(fn.name == callee for fn in module.functions) and callee == "vprintf":
        return None
    fn = next((f for f in module.functions if f.name == callee), None)
    if fn is None or any(
        "%ctaid" in o or "%nctaid" in o for x in fn.instructions for o in x.operands
    ):
        return (
            f"call to {callee or 'a function'} at PTX line {ins.line}: device functions "
            "are not instrumented (inline them)"
        )
    return None


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
    early = _early_returns(entry.instructions, cfg)
    if early is None:
        return [], []
    if not barriers:
        return early, []
    return early, _return_barrier_hazards(entry, cfg)


def _early_returns(instrs: list[Instruction], cfg: ControlFlow) -> list[Instruction] | None:
    """Returns before the last one, and guarded branches to a block that only returns;
    None if the kernel never returns."""
    rets = [i for i, ins in enumerate(instrs) if _ends_thread(ins) and ins.base != "trap"]
    if not rets:
        return None
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
    return early


def _return_barrier_hazards(entry: Entry, cfg: ControlFlow) -> list[str]:
    """Branches on a thread-varying predicate where one way returns before any barrier
    and the other reaches one: some threads of a block would wait for ever."""
    instrs = entry.instructions
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

    def returns_first(start: int) -> bool:
        return any(has_ret[x] and not has_bar[x] for x in reach(start, False))

    def meets_barrier(start: int) -> bool:
        return any(has_bar[x] for x in reach(start, True))

    varying = _varying_registers(entry)
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


def _folded(items: list[MemoryAccess], one: str, many: str) -> str:
    """One reason for accesses of one kind: the first in full, the rest counted."""
    first = items[0]
    if len(items) == 1:
        return one.format(kind=first.kind, where=first.where)
    kinds = {a.kind for a in items}
    noun = f"{first.kind}s" if len(kinds) == 1 else "accesses"
    return many.format(count=len(items), kinds=noun, where=first.where)


def _unknown_reasons(report: KernelReport) -> list[str]:
    """Why the analysis cannot tell, folded: one reason per kind of cause."""
    loaded = [a for a in report.accesses if a.origin == "loaded"]
    unattributed = [a for a in report.accesses if a.origin == "unknown"]
    module_writes = [
        a for a in report.accesses if a.origin.startswith("module-var:") and a.kind != "read"
    ]
    reasons = []
    if loaded:
        reasons.append(
            _folded(
                loaded,
                "{kind} through a pointer loaded from memory at {where}: its buffer is not a "
                "parameter",
                "{count} {kinds} through pointers loaded from memory, e.g. at {where}: their "
                "buffers are not parameters",
            )
        )
    if unattributed:
        reasons.append(
            _folded(
                unattributed,
                "{kind} at {where} whose address the analysis cannot attribute",
                "{count} {kinds} whose address the analysis cannot attribute, e.g. at {where}",
            )
        )
    for a in module_writes:
        reasons.append(f"{a.kind} to the module variable {a.origin.split(':', 1)[1]} at {a.where}")
    textures = [u for u in report.unsupported if u.startswith("texture/surface instruction at ")]
    if len(textures) > 1:
        first = textures[0].removeprefix("texture/surface instruction at ")
        reasons.append(f"{len(textures)} texture/surface instructions, e.g. at {first}")
    else:
        reasons += textures
    reasons += [u for u in report.unsupported if u not in textures]
    return reasons


def _classify(report: KernelReport, module: PtxModule) -> Classification:
    unknown = _unknown_reasons(report)
    non: list[str] = []
    for b in report.buffers.values():
        name = f"`{b.display}`"
        if b.access is Access.READ_WRITTEN:
            hazards = b.hazard_reads
            if hazards and (b.writes or b.atomics):
                w = (b.writes or b.atomics)[0]
                more = len(hazards) - 1
                also = f" and {more} more read{'s' if more != 1 else ''}" if more else ""
                non.append(
                    f"parameter {name} is read at {hazards[0].where}{also} and written at "
                    f"{w.where}: a re-run would read values the first run already overwrote"
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
        elif b.access is Access.WRITTEN and b.own_reads:
            reasons.append(
                f"parameter `{b.display}` is written, and read only where the same thread "
                f"wrote it first (at {b.own_reads[0].where}): a re-run reads its own values "
                "there, so that is no re-run hazard"
            )
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
