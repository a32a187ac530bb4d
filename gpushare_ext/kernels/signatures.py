"""Kernels named as the user wrote them: demangled names and source parameter names.

What it is for: a report that says ``scale<float>(float*, float const*, float, int)``
and ``out``, not ``_Z5scaleIfEvPT_PKS0_S0_i`` and ``_Z5scaleIfEvPT_PKS0_S0_i_param_0``.
The names come from the source the compiler saw: nvcc's preprocessed device source
(so ``#if`` inside a signature, macros from ``-D`` and comments are already resolved,
and each line marker says which file a kernel is written in), or the raw text when
NVRTC compiled it.  A kernel is matched to its definition by its unqualified name and
the file and line the PTX's ``.loc`` directives give, so two kernels of one name in
two namespaces keep their own parameter names.  Template kernels that the file never
instantiates are found too, so a report can say how to add an instantiation.

What it must not do: compile, analyse or decide anything; a name it cannot find is
left as the PTX name, never guessed.  It sits just above the PTX model and imports
nothing else of the kernel package.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from gpushare_ext.kernels.ptx import Entry, PtxModule, find_matching, split_top_level

__all__ = [
    "KernelDefinition",
    "base_name",
    "demangle",
    "example_instantiation",
    "kernel_definitions",
    "kernel_name",
    "match_definition",
    "name_entries",
    "strip_comments",
    "uninstantiated_templates",
]

_GLOBAL = re.compile(r"__attribute__\s*\(\(\s*(?:__)?global(?:__)?\s*\)\)|\b__global__\b")
_LINE_MARKER = re.compile(r'^#(?:line)?\s*(\d+)\s+"((?:[^"\\]|\\.)*)"', re.M)
_TEMPLATE_BEFORE = re.compile(r"template\s*<[^;{}]*>\s*(?:(?:static|inline|extern)\s+)*$")
_NOT_NAMES = frozenset(
    [
        "const",
        "volatile",
        "unsigned",
        "signed",
        "int",
        "long",
        "short",
        "char",
        "float",
        "double",
        "bool",
        "void",
        "auto",
        "struct",
        "class",
        "union",
        "enum",
        "typename",
        "__restrict__",
        "__restrict",
        "restrict",
        "register",
        "__half",
        "__nv_bfloat16",
        "half",
    ]
)
_SKIP_WORDS = frozenset(
    ["__attribute__", "__launch_bounds__", "__declspec", "alignas", "__cluster_dims__"]
)


@dataclass(frozen=True)
class KernelDefinition:
    """A ``__global__`` function as written."""

    name: str  # unqualified, as written (``scale``)
    file: str  # the file it is written in, as the compiler named it
    line: int  # the line of its name
    params: tuple[str | None, ...]  # parameter names (None: unnamed)
    param_text: str  # the parameter list as written, on one line
    template: bool
    defined: bool  # a body follows (not a declaration)
    template_params: str = ""  # "typename T, int N" for a template


# ---------------------------------------------------------------------------------------
# Demangling
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cxa_demangle():
    """libstdc++'s demangler and libc's free, or None where there is no libstdc++."""
    for name in ("libstdc++.so.6", ctypes.util.find_library("stdc++")):
        if not name:
            continue
        with contextlib.suppress(OSError):
            lib = ctypes.CDLL(name)
            fn = lib.__cxa_demangle
            fn.restype = ctypes.c_void_p
            fn.argtypes = [
                ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
            ]  # fmt: skip
            libc = ctypes.CDLL(None)
            libc.free.argtypes = [ctypes.c_void_p]
            return fn, libc.free
    return None


@functools.lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    """The C++ name of a mangled symbol (``scale<float>(float*, int)``); others unchanged."""
    if not name.startswith("_Z"):
        return name
    found = _cxa_demangle()
    if found is not None:
        fn, free = found
        status = ctypes.c_int(0)
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if ptr:
            try:
                return ctypes.string_at(ptr).decode(errors="replace")
            finally:
                free(ptr)
        return name
    tool = shutil.which("c++filt")
    if tool:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([tool, name], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
    return name


def base_name(cxx_name: str) -> str:
    """``ns::scale<float>(float*, int)`` -> ``scale``."""
    cxx_name = cxx_name.replace("(anonymous namespace)", "anonymous-namespace")
    head = cxx_name
    depth = 0
    for i, ch in enumerate(cxx_name):  # the parameter list starts at the first '(' outside <>
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            head = cxx_name[:i]
            break
    head = head.strip()
    while head.endswith(">"):  # template arguments of the function itself
        depth = 0
        for i in range(len(head) - 1, -1, -1):
            if head[i] == ">":
                depth += 1
            elif head[i] == "<":
                depth -= 1
                if depth == 0:
                    head = head[:i].rstrip()
                    break
        else:
            break
    return head.rsplit("::", 1)[-1].split()[-1]


def kernel_name(mangled: str) -> str:
    """What a report calls a kernel: its C++ name without the ``void`` a template's
    demangled name starts with (``scale<float>(float*, int)``)."""
    name = demangle(mangled)
    return name[5:] if name.startswith("void ") else name


# ---------------------------------------------------------------------------------------
# Definitions in source text
# ---------------------------------------------------------------------------------------


def strip_comments(text: str) -> str:
    """Comments blanked to spaces (line breaks kept, so lines keep their numbers)."""
    out = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":
            j = i + 1
            while j < n and text[j] != ch and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            j = i
            while j < n and text[j] not in "\"'/":
                j += 1
            if j == i:
                j += 1
            out.append(text[i:j])
            i = j
    return "".join(out)


class _Positions:
    """File and line of a position in a text with (or without) line markers."""

    def __init__(self, text: str, default_file: str) -> None:
        self.text = text
        self.marks: list[tuple[int, str, int]] = [(0, default_file, 1)]
        for m in _LINE_MARKER.finditer(text):
            end = text.find("\n", m.end())
            self.marks.append((len(text) if end < 0 else end + 1, m.group(2), int(m.group(1))))
        self.starts = [pos for pos, _, _ in self.marks]

    def at(self, pos: int) -> tuple[str, int]:
        k = bisect.bisect_right(self.starts, pos) - 1
        start, file, line = self.marks[k]
        return file, line + self.text.count("\n", start, pos)


def _match_close(text: str, i: int, open_ch: str, close_ch: str) -> int:
    return find_matching(text, i, open_ch, close_ch, limit=20_000)


def _name_and_params(text: str, start: int) -> tuple[str, int, int] | None:
    """After ``__global__``: (name, index of '(' of its parameters, index of ')')."""
    i = start
    last_ident = None
    limit = min(len(text), start + 4000)
    while i < limit:
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        m = re.compile(r"[A-Za-z_]\w*").match(text, i)
        if m:
            word = m.group(0)
            i = m.end()
            if word in _SKIP_WORDS:
                j = text.find("(", i)
                close = _match_close(text, j, "(", ")") if j >= 0 else -1
                if close < 0:
                    return None
                i = close + 1
                last_ident = None
            else:
                last_ident = word
            continue
        if ch == "(":
            if last_ident is None:
                return None
            close = _match_close(text, i, "(", ")")
            return (last_ident, i, close) if close >= 0 else None
        if text.startswith("::", i):
            i += 2
            continue
        if ch == "<":  # an explicit specialisation's arguments: scale<float>(...)
            close = _match_close(text, i, "<", ">")
            if close < 0:
                return None
            i = close + 1
            continue
        if ch in "*&":
            i += 1
            continue
        return None
    return None


def _split_params(text: str) -> list[str]:
    """Parameters at top-level commas (template arguments count as brackets)."""
    return split_top_level(text, "([{<", ")]}>")


def _param_name(piece: str) -> str | None:
    """The name of one declared parameter (``const float* __restrict__ x`` -> ``x``)."""
    piece = piece.split("=", 1)[0].strip()  # a default argument
    pointer = re.search(r"\(\s*[*&]\s*([A-Za-z_]\w*)\s*\)", piece)  # float (*f)(int)
    if pointer:
        return pointer.group(1)
    piece = re.sub(r"\[[^\]]*\]\s*$", "", piece).strip()  # int a[4]
    piece = re.sub(r"__attribute__\s*\(\(.*?\)\)", "", piece).strip()
    if not piece or piece.endswith(("*", "&", ">", "::")):
        return None
    words = re.findall(r"[A-Za-z_]\w*", piece)
    if len(words) < 2:
        return None  # a type alone (float, T)
    last = words[-1]
    if last in _NOT_NAMES:
        return None
    before = piece[: piece.rfind(last)].rstrip()
    if not before or before.endswith("::"):
        return None
    return last


def kernel_definitions(text: str, default_file: str = "") -> list[KernelDefinition]:
    """Every ``__global__`` function in ``text`` (preprocessed, or plain source)."""
    positions = _Positions(text, default_file)
    found: list[KernelDefinition] = []
    for m in _GLOBAL.finditer(text):
        parsed = _name_and_params(text, m.end())
        if parsed is None:
            continue
        name, open_at, close_at = parsed
        inner = text[open_at + 1 : close_at].strip()
        pieces = [] if inner in ("", "void") else _split_params(inner)
        after = text[close_at + 1 : close_at + 400].lstrip()
        after = re.sub(r"^(?:__attribute__\s*\(\(.*?\)\)\s*)+", "", after, flags=re.S)
        file, line = positions.at(open_at)
        head_start = max(0, m.start() - 400)
        header = _TEMPLATE_BEFORE.search(text[head_start : m.start()])
        found.append(
            KernelDefinition(
                name=name,
                file=file,
                line=line,
                params=tuple(_param_name(p) for p in pieces),
                param_text=" ".join(inner.split()),
                template=header is not None,
                template_params=_template_params(header.group(0)) if header else "",
                defined=after.startswith("{"),
            )
        )
    return found


def _template_params(header: str) -> str:
    inside = header[header.index("<") + 1 : header.rindex(">")]
    return " ".join(inside.split())


def example_instantiation(d: KernelDefinition) -> str:
    """An explicit instantiation of a template kernel, with float for each type
    parameter and 1 for each value parameter (the user puts in what they use)."""
    args = []
    substitutions: dict[str, str] = {}
    for piece in _split_params(d.template_params):
        words = re.findall(r"[A-Za-z_]\w*", piece.split("=", 1)[0])
        if not words:
            continue
        name = words[-1]
        value = "float" if words[0] in ("typename", "class") else "1"
        args.append(value)
        substitutions[name] = value
    params = re.sub(
        r"[A-Za-z_]\w*", lambda m: substitutions.get(m.group(0), m.group(0)), d.param_text
    )
    return f"template __global__ void {d.name}<{', '.join(args)}>({params});"


def _same_file(a: str, b: str) -> bool:
    if not a or not b:
        return True
    if os.path.normpath(a) == os.path.normpath(b):
        return True
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return os.path.basename(a) == os.path.basename(b)


def match_definition(
    definitions: Iterable[KernelDefinition],
    name: str,
    param_count: int,
    file: str | None,
    line: int | None,
) -> KernelDefinition | None:
    """The definition of the kernel ``name`` whose body holds ``file``:``line`` (the first
    ``.loc`` of its PTX), with ``param_count`` parameters; None if it is not certain."""
    candidates = [
        d for d in definitions if d.name == name and d.defined and len(d.params) == param_count
    ]
    if file is not None and line is not None:
        here = [d for d in candidates if _same_file(d.file, file) and d.line <= line]
        if here:
            return max(here, key=lambda d: d.line)
        return None
    return candidates[0] if len(candidates) == 1 else None


def uninstantiated_templates(
    definitions: Iterable[KernelDefinition], compiled_names: Iterable[str], user_file
) -> list[KernelDefinition]:
    """Template kernels written in the user's files that no compiled kernel comes from."""
    seen = set(compiled_names)
    out = []
    for d in definitions:
        known = any(o.name == d.name and o.file == d.file for o in out)
        if d.template and d.defined and d.name not in seen and user_file(d.file) and not known:
            out.append(d)
    return out


def _first_location(module: PtxModule, entry: Entry) -> tuple[str | None, int | None]:
    for ins in entry.instructions:
        if ins.src_line is not None and ins.src_file is not None:
            return module.files.get(ins.src_file), ins.src_line
    return None, None


def name_entries(
    module: PtxModule, definitions: list[KernelDefinition]
) -> dict[str, KernelDefinition]:
    """Give each entry the parameter names of its definition (where it is certain);
    returns the definition found per entry."""
    found_for: dict[str, KernelDefinition] = {}
    for entry in module.entries:
        file, line = _first_location(module, entry)
        found = match_definition(
            definitions, base_name(kernel_name(entry.name)), len(entry.params), file, line
        )
        if found is None:
            continue
        found_for[entry.name] = found
        for param, name in zip(entry.params, found.params, strict=True):
            if name:
                entry.source_names[param.name] = name
    return found_for
