"""Calls into device functions: which ones the analysis of a kernel may step over.

What it is for: the analysis classifies a kernel by the memory accesses of its own body.
A ``call`` into a ``.func`` leaves that sound only when the callee (and everything it
calls in turn) touches no memory another thread, block or run could see: it reads its
parameters, works in registers and in its own local frame, and returns.  Such a callee
changes nothing the classification looks at (a Numba device function compiled on its
own and linked in, ``cuda.declare_device``: ``linking.py`` puts its body into the
kernel's module).  :func:`call_refusal` says why a call is not of that kind (no body in
the PTX, memory accesses, a barrier, the block index, ``exit`` ...), in words a user
can act on; :func:`callees` lists what an entry reaches through its calls.

What it must not do: follow a callee's memory accesses (a callee that touches memory
keeps the kernel *unknown*, never classified by a guess), rewrite PTX or touch CUDA.
"""

from __future__ import annotations

from gpushare_ext.kernels.dataflow import LOCAL, address_of, compute_taint, operand_taint
from gpushare_ext.kernels.ptx import Entry, Instruction, PtxModule

__all__ = ["EXTERNAL_HARMLESS", "call_refusal", "call_target", "callees"]

#: Functions the driver supplies that write no buffer of the kernel's (``printf``).
EXTERNAL_HARMLESS = frozenset({"vprintf"})

_MEMORY = {"ld", "ldu", "st", "atom", "red", "cp", "tex", "tld4", "suld", "sust", "sured"}
_MEMORY_PREFIXES = ("mbarrier", "multimem", "st.async", "red.async", "cp.async", "wgmma")
_BARRIERS = ("bar", "barrier")
# Special registers the transform replaces or refuses in the kernel's own body only.
_SPECIALS = {
    "%ctaid": "reads the block index",
    "%nctaid": "reads the grid's size in blocks",
    "%cluster": "reads a cluster register",
    "%is_explicit_cluster": "reads a cluster register",
    "%envreg": "reads an environment register (a cooperative launch's grid)",
}


def call_target(ins: Instruction) -> str:
    """The function a ``call`` names: ``call.uni (retval0), f, (param0);`` -> ``f``;
    ``""`` for a call through a register (``call (r), %rd4, (a), proto;``)."""
    for op in ins.operands:
        if not op.startswith("("):
            return "" if op.startswith("%") else op
    return ""


def _function(module: PtxModule, name: str) -> Entry | None:
    return next((f for f in module.functions if f.name == name), None)


def callees(module: PtxModule, entry: Entry) -> list[Entry]:
    """The functions with a body in ``module`` that ``entry`` calls, directly or not."""
    found: dict[str, Entry] = {}
    work = [entry]
    while work:
        for ins in work.pop().instructions:
            fn = _function(module, call_target(ins)) if ins.base == "call" else None
            if fn is not None and fn.name not in found:
                found[fn.name] = fn
                work.append(fn)
    return list(found.values())


def call_refusal(module: PtxModule, ins: Instruction) -> str | None:
    """Why the analysis cannot step over this call, or None: the callee has a body in
    the module and it and its own callees touch only their parameters, registers and
    local frames (or it is one of :data:`EXTERNAL_HARMLESS`)."""
    callee = call_target(ins)
    if not callee:
        return (
            f"call through a register at PTX line {ins.line}: the analysis cannot tell "
            "which function it runs"
        )
    found = _refusal(module, callee, set())
    if found is None:
        return None
    culprit, why = found
    what = f"call to {callee} at PTX line {ins.line}"
    if culprit == callee:
        return f"{what}: it {why}"
    return f"{what}: it calls {culprit}, which {why}"


def _refusal(module: PtxModule, name: str, seen: set[str]) -> tuple[str, str] | None:
    """(the function at fault, what it does) for the first function reached from
    ``name`` whose effects the analysis cannot step over, or None."""
    fn = _function(module, name)
    if fn is None:
        if name in EXTERNAL_HARMLESS:
            return None
        return name, (
            "has no body in the kernel's PTX nor in PTX it is linked with, so it could "
            "write any buffer"
        )
    if name in seen:
        return None
    seen.add(name)
    why = _body_refusal(module, fn)
    if why is not None:
        return name, why
    for ins in fn.instructions:
        if ins.base == "call":
            inner = call_target(ins)
            if not inner:
                return name, f"calls a function through a register at PTX line {ins.line}"
            found = _refusal(module, inner, seen)
            if found is not None:
                return found
    return None


def _body_refusal(module: PtxModule, fn: Entry) -> str | None:
    """What in ``fn``'s own body the analysis cannot step over, or None."""
    pointers = [p.name for p in fn.params if p.may_be_pointer]
    taint = compute_taint(fn, pointers, module.module_vars)
    for ins in fn.instructions:
        where = f"({ins.opcode} at PTX line {ins.line})"
        for special, what in _SPECIALS.items():
            if any(special in op for op in ins.operands):
                return f"{what} {where}: only the kernel's own body is rewritten"
        if ins.base in _BARRIERS and "warp" not in ins.parts:
            return f"waits at a barrier {where}"
        if ins.base == "exit":
            return f"ends its thread {where}"
        touch = _memory_touch(ins, taint, module)
        if touch:
            return (
                f"{touch} memory {where}: the analysis does not follow a device "
                "function's memory accesses"
            )
    return None


def _memory_touch(ins: Instruction, taint: dict, module: PtxModule) -> str:
    """``"reads"``/``"writes"`` where ``ins`` touches memory outside its function's own
    parameters and local frame (constant memory may be read), else ``""``."""
    memory = ins.base in _MEMORY or ins.opcode.startswith(_MEMORY_PREFIXES)
    if not memory:
        return ""
    kind = "reads" if ins.base in ("ld", "ldu", "tex", "tld4", "suld") else "writes"
    space = ins.state_space
    if space in ("param", "local") or (space == "const" and kind == "reads"):
        return ""
    addr = address_of(ins)
    if space == "generic" and addr is not None:
        origins = operand_taint(f"[{addr}]", taint, module.module_vars)
        if origins and origins <= {LOCAL}:
            return ""  # its own stack frame, through a generic address
    return kind
