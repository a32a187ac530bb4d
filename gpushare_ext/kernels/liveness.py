"""Register liveness of one PTX entry: which registers hold a value a later instruction
still reads, at a given point of the body.

What it is for: the state-saving abort (``transform.SaveThreadState``) stores, when a
thread stops at a loop back-edge, exactly the registers live at that loop's header and
reloads them there when the launch goes on. Saving fewer would lose state; saving more would stretch
registers' live ranges over the loop and cost the kernel registers it runs without today.

What it must not do: rewrite anything or guess. A register the analysis cannot type is
reported, never silently skipped; a guarded write (``@%p mov``) may not happen, so it
never ends a live range.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpushare_ext.kernels.ptx import Entry, Instruction
from gpushare_ext.kernels.report import ControlFlow

__all__ = ["RegisterFile", "live_before", "recomputable_registers", "register_file"]

# Opcodes whose first operand is read, not written (stores, branches, barriers ...).
_READS_ALL = {
    "st", "red", "bar", "barrier", "bra", "brx", "ret", "exit", "membar", "fence",
    "prefetch", "prefetchu", "cp", "trap", "brkpt", "nanosleep", "pmevent", "call",
    "discard", "applypriority", "griddepcontrol", "setmaxnreg", "stmatrix", "multimem",
}  # fmt: skip

_DECL = re.compile(r"^\.reg\s+\.(\w+)\s+(.*)$", re.S)
_RANGE = re.compile(r"^(%[\w$]+)<(\d+)>$")


@dataclass(frozen=True)
class RegisterFile:
    """The registers an entry declares at its top scope: name -> PTX type (``f32``,
    ``b64``, ``pred`` ...); ``nested``: names declared inside a ``{ }`` scope."""

    types: Mapping[str, str]
    nested: frozenset[str]

    def __contains__(self, name: object) -> bool:
        return name in self.types or name in self.nested


def register_file(entry: Entry) -> RegisterFile:
    """Parse ``.reg`` declarations (``.reg .f32 %f<19>;`` declares ``%f0`` .. ``%f18``)."""
    types: dict[str, str] = {}
    nested: set[str] = set()
    for s in entry.body:
        if s.kind != "decl":
            continue
        m = _DECL.match(s.text.strip())
        if m is None:
            continue
        kind, names = m.group(1), m.group(2)
        for name in (n.strip() for n in names.split(",")):
            r = _RANGE.match(name)
            declared = [f"{r.group(1)}{k}" for k in range(int(r.group(2)))] if r else [name]
            if s.depth:
                nested.update(declared)
            else:
                types.update(dict.fromkeys(declared, kind))
    return RegisterFile(types, frozenset(nested))


def _registers_named(operand: str) -> list[str]:
    return re.findall(r"%[A-Za-z_$][\w$]*", operand)


def uses_and_defs(ins: Instruction, regs: RegisterFile) -> tuple[set[str], set[str]]:
    """Registers ``ins`` reads and the registers it surely writes (none when guarded)."""
    ops = list(ins.operands)
    uses: set[str] = set()
    defs: set[str] = set()
    if ins.guard:
        uses.update(_registers_named(ins.guard))
    writes_first = bool(ops) and ins.base not in _READS_ALL and not ops[0].startswith("[")
    for k, op in enumerate(ops):
        target = defs if (k == 0 and writes_first) else uses
        target.update(_registers_named(op))
    if ins.guard:
        uses |= defs  # may not be written: the old value lives on through it
        defs = set()
    return {r for r in uses if r in regs}, {r for r in defs if r in regs}


def live_before(
    instrs: list[Instruction], cfg: ControlFlow, regs: RegisterFile, points: Iterable[int]
) -> dict[int, frozenset[str]]:
    """For each instruction index in ``points``: the registers live just before it
    (``len(instrs)``, the end, has none)."""
    per_ins = [uses_and_defs(ins, regs) for ins in instrs]
    n = len(cfg.blocks)
    gen: list[set[str]] = []
    kill: list[set[str]] = []
    for s, e in cfg.blocks:
        g: set[str] = set()
        k: set[str] = set()
        for i in range(e - 1, s - 1, -1):
            uses, defs = per_ins[i]
            g = (g - defs) | uses
            k |= defs
        gen.append(g)
        kill.append(k)
    live_in: list[set[str]] = [set() for _ in range(n)]
    changed = True
    while changed:
        changed = False
        for b in range(n - 1, -1, -1):
            out = set().union(*(live_in[t] for t in cfg.succ[b])) if cfg.succ[b] else set()
            new = gen[b] | (out - kill[b])
            if new != live_in[b]:
                live_in[b] = new
                changed = True
    result: dict[int, frozenset[str]] = {}
    for at in points:
        if at >= len(instrs):
            result[at] = frozenset()
            continue
        b = cfg.block_of(at)
        s, e = cfg.blocks[b]
        live = set().union(*(live_in[t] for t in cfg.succ[b])) if cfg.succ[b] else set()
        for i in range(e - 1, at - 1, -1):
            uses, defs = per_ins[i]
            live = (live - defs) | uses
        result[at] = frozenset(live)
    return result


#: Operations whose result is a function of their operands alone (no memory, no clock).
_PURE = {
    "mov", "cvt", "cvta", "add", "sub", "mul", "mad", "shl", "shr", "and", "or", "xor",
    "not", "neg", "min", "max", "selp", "setp", "abs", "div", "rem", "mul24", "mad24",
}  # fmt: skip
#: Special registers with the same value whenever a thread of the same logical block
#: reads them (the block id is replaced by the logical block's, which a slice restores).
_STABLE_SPECIALS = {"%tid", "%ntid", "%ctaid", "%nctaid"}


def recomputable_registers(entry: Entry, regs: RegisterFile) -> dict[str, int]:
    """Registers whose one definition can simply be run again: register -> the index of
    that instruction. A parameter load, or a pure operation on immediates, stable special
    registers and other such registers (``ld.param``, ``cvta``, ``mul.wide`` of
    ``%ntid`` ...). Reloading them from the parameters rather than from a save area
    keeps ptxas free to fold them into constant-bank operands."""
    instrs = entry.instructions
    defs: dict[str, list[int]] = {}
    for i, ins in enumerate(instrs):
        for r in _written(ins, regs):
            defs.setdefault(r, []).append(i)
    candidates: dict[str, int] = {}
    for r, where in defs.items():
        if len(where) != 1:
            continue
        ins = instrs[where[0]]
        pure = ins.base in _PURE or (ins.base == "ld" and ins.state_space == "param")
        if ins.guard or not pure or "volatile" in ins.parts:
            continue
        candidates[r] = where[0]
    changed = True
    while changed:  # keep only those whose every source is itself recomputable
        changed = False
        for r, i in list(candidates.items()):
            for name in _registers_named(", ".join(instrs[i].operands[1:])):
                ok = name in candidates if name in regs else name in _STABLE_SPECIALS
                if not ok:
                    del candidates[r]
                    changed = True
                    break
    return candidates


def _written(ins: Instruction, regs: RegisterFile) -> list[str]:
    ops = list(ins.operands)
    if not ops or ins.base in _READS_ALL or ops[0].startswith("["):
        return []
    return [r for r in _registers_named(ops[0]) if r in regs]
