"""Device functions a kernel calls from PTX it is linked with, put into its own module.

What it is for: Numba links a kernel with PTX files (``@cuda.jit(link=[...])`` calling
a ``cuda.declare_device`` function): the kernel's PTX only declares the callee
(``.extern .func``) and the linker (cuLink, nvJitLink) brings its body in.  A
preemptible twin is loaded from one PTX text, so :func:`link_device_functions` replaces
each such declaration with the callee's definition from the linked PTX, and with the
functions that one calls in turn, where the two agree (same parameters and return
value, a target the kernel's covers, no module variables of their own).  The analysis
then sees the callee's body like that of a function of the kernel's own module
(``callees.py`` decides whether a call to it leaves the kernel's classification sound).

What it must not do: decide whether a callee is safe to step over, compile, or touch
CUDA.  A declaration it cannot resolve stays as it is, so the analysis refuses the call;
:attr:`Linked.notes` says why it was left.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare_ext.kernels.callees import call_target
from gpushare_ext.kernels.ptx import (
    Entry,
    KernelError,
    Param,
    PtxModule,
    parse_ptx,
    render_entry,
    return_params,
    set_version,
)

__all__ = ["Linked", "link_device_functions"]


@dataclass(frozen=True)
class Linked:
    """The kernel's PTX with the bodies it could resolve (``text``), the functions whose
    declarations it replaced, and why a declaration the kernel calls was left."""

    text: str
    resolved: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Library:
    """One linked PTX text, parsed."""

    number: int  # 1-based, in the order given
    module: PtxModule

    def function(self, name: str) -> Entry | None:
        return next((f for f in self.module.functions if f.name == name), None)

    def exports(self, name: str) -> Entry | None:
        fn = self.function(name)
        exported = fn is not None and any(k in fn.linkage for k in (".visible", ".weak"))
        return fn if exported else None


def _signature(return_decl: str, params: Sequence[Param]) -> tuple:
    """What a call and a definition must agree on: each parameter's and return value's
    type, size, array length and alignment (names do not matter)."""
    returns = return_params(return_decl)
    return tuple((p.type, p.size, p.array, p.align) for p in [*returns, *params]), len(returns)


def _target_number(target: str) -> tuple[int, str]:
    """``sm_90a`` -> (90, "a"); an unknown target -> (0, its text)."""
    m = re.match(r"\s*sm_(\d+)([a-z]?)", target)
    return (int(m.group(1)), m.group(2)) if m else (0, target.strip())


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


class _Resolver:
    """Finds the definitions for a kernel module's declarations in its libraries."""

    def __init__(self, kernel: PtxModule, libraries: list[_Library]) -> None:
        self.kernel = kernel
        self.libraries = libraries
        self.taken: dict[str, tuple[_Library, Entry]] = {}  # name -> where its body is
        # Where the linked bodies go: before the kernel module's first definition.
        self.insert_at = len(kernel.chunks[0]) if isinstance(kernel.chunks[0], str) else 0

    def provider(self, name: str, near: _Library | None) -> tuple[_Library, Entry] | None:
        """The definition a call to ``name`` from ``near`` (None: the kernel) links to:
        a function of the same library first, else one another library exports."""
        if near is not None and (fn := near.function(name)) is not None:
            return near, fn
        for library in self.libraries:
            if library is not near and (fn := library.exports(name)) is not None:
                return library, fn
        return None

    def closure(self, name: str) -> dict[str, tuple[_Library, Entry]] | str:
        """Every body a call to kernel-declared ``name`` needs, callees first, or why
        it cannot be linked in."""
        found = self.provider(name, None)
        if found is None:
            return ""  # not linked in at all: the analysis says the body is missing
        order: dict[str, tuple[_Library, Entry]] = {}
        visiting: set[str] = set()

        def visit(fname: str, library: _Library, fn: Entry) -> str:
            if fname in order:
                return ""
            if fname in visiting:
                return f"{fname} is recursive"
            visiting.add(fname)
            why = self._unfit(library, fn)
            for ins in fn.instructions if not why else ():
                callee = call_target(ins) if ins.base == "call" else ""
                inner = self.provider(callee, library) if callee else None
                if inner is not None:
                    why = visit(callee, *inner)
                elif callee and not self._declared(callee):
                    why = f"{fname} calls {callee}, which neither the kernel's PTX declares "
                    why += "nor linked PTX defines"
                if why:
                    break
            visiting.discard(fname)
            if not why:
                order[fname] = (library, fn)
            return why

        why = visit(name, *found)
        return why or order

    def _declared(self, name: str) -> bool:
        """Declared, without a body, before the kernel's first definition (where the
        linked bodies go): a call to it from a linked body then assembles."""
        return any(d.name == name and d.end <= self.insert_at for d in self.kernel.declarations)

    def _unfit(self, library: _Library, fn: Entry) -> str:
        """Why ``fn`` cannot be copied into the kernel's module, or ""."""
        kernel_target, target = (
            _target_number(self.kernel.target),
            _target_number(library.module.target),
        )
        where = f"{fn.name} (linked PTX {library.number})"
        if library.module.address_size != self.kernel.address_size:
            return f"{where} has another address size"
        if target != kernel_target and (target[1] or not target[0] or target[0] > kernel_target[0]):
            return f"{where} targets {library.module.target}, the kernel {self.kernel.target}"
        names = {op.strip("[]").split("+")[0] for ins in fn.instructions for op in ins.operands}
        used = sorted(names & set(library.module.module_vars))
        if used:
            return f"{where} uses the module variable {used[0]} of its own PTX"
        return ""

    def take(self, name: str) -> str:
        """Link in the body of kernel-declared ``name`` and what it calls; "" when done
        or when no linked PTX defines it, else why it was left out."""
        closure = self.closure(name)
        if isinstance(closure, str):
            return closure
        declared = {d.name: d for d in self.kernel.declarations}
        for fname, (_, fn) in closure.items():
            d = declared.get(fname)
            if d is not None and _signature(d.return_decl, d.params) != _signature(
                fn.return_decl, fn.params
            ):
                return (
                    f"the kernel declares other parameters or another return value for "
                    f"{fname} (a Numba-ABI declaration of a C-ABI function, or the reverse?)"
                )
        defined = {f.name for f in self.kernel.functions}
        for fname, (_, fn) in closure.items():
            if fname in defined or self.taken.get(fname, (None, fn))[1] is not fn:
                return f"{fname} is defined twice"
        self.taken.update(closure)
        return ""


def link_device_functions(ptx: str, linked: Sequence[str]) -> Linked:
    """``ptx`` with each declared function the linked PTX texts define replaced by that
    definition (and the functions it calls), in dependency order, where both agree.

    Raises :class:`KernelError` only for the kernel's own PTX; a linked text that does
    not parse is left out with a note."""
    kernel = parse_ptx(ptx)
    defined = {f.name for f in kernel.functions}
    wanted = [d for d in kernel.declarations if d.name not in defined]
    if not wanted or not linked:
        return Linked(ptx)
    libraries: list[_Library] = []
    notes: list[str] = []
    for number, text in enumerate(linked, start=1):
        try:
            libraries.append(_Library(number, parse_ptx(text)))
        except KernelError as exc:
            notes.append(f"linked PTX {number} could not be read: {exc.message}")
    resolver = _Resolver(kernel, libraries)
    for declaration in wanted:
        why = resolver.take(declaration.name)
        if why:
            notes.append(f"the linked {declaration.name} was left out: {why}")
    if not resolver.taken:
        return Linked(ptx, (), tuple(notes))
    return Linked(_spliced(ptx, kernel, resolver), tuple(resolver.taken), tuple(notes))


def _spliced(ptx: str, kernel: PtxModule, resolver: _Resolver) -> str:
    """The kernel's text with the linked bodies just before its first definition (after
    the declarations and variables above it), the replaced declarations gone, and
    ``.version`` raised to the newest of the texts used."""
    at = resolver.insert_at
    bodies = "".join(_body(fn) + "\n" for _, fn in resolver.taken.values())
    edits = [(d.start, d.end, "") for d in kernel.declarations if d.name in resolver.taken]
    edits.append((at, at, bodies))
    out: list[str] = []
    pos = 0
    for start, end, insert in sorted(edits, key=lambda e: (e[0], e[1])):
        out += [ptx[pos:start], insert]
        pos = end
    out.append(ptx[pos:])
    text = "".join(out)
    versions = [_version(lib.module.version) for lib, _ in resolver.taken.values()]
    newest = max(versions, default=(0, 0))
    if newest > _version(kernel.version):
        text = set_version(text, f"{newest[0]}.{newest[1]}")
    return text


def _body(fn: Entry) -> str:
    """``fn``'s definition without its ``.loc`` directives (their file numbers are its
    own module's ``.file`` table, which is not copied)."""
    lines = [
        s.render() for s in fn.body if not (s.kind == "directive" and s.text.startswith(".loc"))
    ]
    return render_entry(fn, body_lines=lines)
