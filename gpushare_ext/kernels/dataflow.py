"""Control flow and taint of one PTX entry: the facts the analysis steps stand on.

What it is for: basic blocks, successors, loops and loop bodies (:func:`build_cfg`);
which parameters (or loaded pointers, local and shared addresses, module variables)
every register's value may come from (:func:`compute_taint`); by-value struct fields
that may hold pointers; and the registers whose value differs between the threads of a
block.

What it must not do: decide what a kernel does to its buffers or classify it (the
analysis and the classification do, from these facts); rewrite PTX or touch CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpushare_ext.kernels.ptx import Entry, Instruction
from gpushare_ext.kernels.report import ControlFlow

__all__ = [
    "LOADED",
    "LOCAL",
    "SHARED",
    "SYM",
    "address_of",
    "build_cfg",
    "compute_taint",
    "dests_and_sources",
    "ends_thread",
    "is_branch",
    "named_variables",
    "operand_taint",
    "registers_in",
    "struct_pointer_fields",
    "varying_registers",
]

# Taint origins that are not parameters.
LOADED = "@loaded"  # a 64-bit value read from memory (a pointer loaded from memory)
LOCAL = "@local"  # a generic address into the stack / local depot
SHARED = "@shared"  # a generic address into shared memory
SYM = "@sym:"  # prefix: the address of a module-scope variable

_NO_DEST = {
    "st", "red", "bar", "barrier", "bra", "ret", "exit", "membar", "fence", "prefetch",
    "prefetchu", "cp", "trap", "brkpt", "nanosleep", "pmevent", "griddepcontrol",
    "setmaxnreg", "stmatrix", "call", "discard", "applypriority", "st.async", "red.async",
    "multimem", "elect", "wgmma", "tcgen05", "cp.async",
}  # fmt: skip
_POINTER_PRESERVING = {"mov", "cvta", "cvt", "and", "or", "xor", "add", "sub", "selp", "min", "max"}
_VARYING_SPECIALS = ("%tid", "%laneid", "%warpid", "%smid", "%clock", "%globaltimer", "%lanemask")


# ---------------------------------------------------------------------------------------
# Control flow
# ---------------------------------------------------------------------------------------


def is_branch(ins: Instruction) -> bool:
    return ins.base in ("bra", "brx")


def ends_thread(ins: Instruction) -> bool:
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
        if is_branch(ins) or ends_thread(ins):
            leaders.add(i + 1)
    starts = sorted(x for x in leaders if x <= len(instrs))
    return [(s, e) for s, e in zip(starts, [*starts[1:], len(instrs)], strict=True) if s < e]


def _successors(
    instrs: list[Instruction], blocks: list[tuple[int, int]], labels: dict[str, int], b: int
) -> list[int]:
    last = instrs[blocks[b][1] - 1]
    falls_through = b + 1 < len(blocks)
    if is_branch(last):
        target = last.operands[0] if last.operands else ""
        out = [labels[target]] if target in labels else []
        return out + ([b + 1] if last.guard and falls_through else [])
    if ends_thread(last):
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


def registers_in(operand: str) -> list[str]:
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


def address_of(ins: Instruction) -> str | None:
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
        addr = address_of(ins) or ""
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


def dests_and_sources(ins: Instruction) -> tuple[list[str], list[str]]:
    base = ins.base
    ops = list(ins.operands)
    if base in _NO_DEST or ins.opcode.startswith(tuple(_NO_DEST)) or not ops:
        return [], [r for o in ops for r in registers_in(o)]
    dest = ops[0]
    dests = [r for part in dest.split("|") for r in registers_in(part)]
    return dests, [r for o in ops[1:] for r in registers_in(o)]


def operand_taint(op: str, taint: Mapping[str, frozenset[str]], mod_vars: Mapping[str, str]):
    regs = registers_in(op)
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
    local_vars = named_variables(entry, mod_vars)
    changed = True
    while changed:
        changed = False
        for ins in entry.instructions:
            dests, _ = dests_and_sources(ins)
            new = _origins(ins, taint, ptrs, local_vars) if dests else set()
            for d in dests if new else ():
                old = taint.get(d, frozenset())
                if not new <= old:
                    taint[d] = old | new
                    changed = True
    return taint


def named_variables(entry: Entry, mod_vars: Mapping[str, str]) -> dict[str, str]:
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
            pname = _param_slot(address_of(ins) or "")
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
        out |= operand_taint(o, taint, local_vars)
    return out


def varying_registers(entry: Entry) -> set[str]:
    """Registers whose value may differ between threads of a block (flow-insensitive)."""
    varying: set[str] = set()
    changed = True
    instrs = entry.instructions
    while changed:
        changed = False
        for ins in instrs:
            dests, srcs = dests_and_sources(ins)
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
