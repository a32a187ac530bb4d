"""PTX text model: a small, faithful parser for the PTX that NVRTC and Numba emit.

What it is for: turning PTX text into entries, parameters, register declarations,
labels and instructions (with their line numbers in the PTX text and, where the
compiler left ``.loc`` directives, the source line), and turning a rewritten entry back
into text. It is the bottom of the kernel pipeline (parse -> analyse -> classify ->
transform -> assemble) and defines the layer's one error type, :class:`KernelError`.

What it must not do: interpret the program (that is ``analysis.py``), rewrite it (that
is ``transform.py``) or touch CUDA. Text in, model out; model in, text out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpushare_ext.errors import GpushareError

__all__ = [
    "Declaration",
    "Entry",
    "Instruction",
    "KernelError",
    "Param",
    "PtxModule",
    "Statement",
    "parse_ptx",
    "return_params",
    "split_operands",
]


class KernelError(GpushareError):
    """The one error of the kernels layer: a stable ``code`` and a human ``message``.

    ``step`` names the pipeline step that failed (``parse``, ``compile``, ``transform:...``,
    ``assemble``, ``launch``), ``log`` carries a compiler or assembler log when there is one.
    """

    def __init__(self, code: str, message: str, *, step: str = "", log: str = "") -> None:
        self.code = code
        self.message = message
        self.step = step
        self.log = log
        text = f"[{code}] {message}"
        if step:
            text = f"{step}: {text}"
        if log:
            text = f"{text}\n{log.rstrip()}"
        super().__init__(text)


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------

_SIZE_OF_TYPE = {
    "b8": 1, "u8": 1, "s8": 1, "pred": 1,
    "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "tf32": 4,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8,
    "b128": 16,
}  # fmt: skip

STATE_SPACES = ("global", "shared", "local", "param", "const", "tex")


@dataclass(frozen=True)
class Param:
    """One kernel parameter as the PTX declares it (``.param .u64 .ptr.align 8 name``)."""

    name: str
    type: str  # "u64", "f32", "b8" (for byte arrays: structs passed by value)
    size: int  # bytes the launch must supply
    align: int
    array: int | None = None  # element count for ``.b8 name[16]``

    @property
    def may_be_pointer(self) -> bool:
        return self.array is None and self.size == 8 and self.type in ("u64", "b64", "s64")


@dataclass(frozen=True)
class Instruction:
    """One PTX instruction: optional guard, dotted opcode and operand texts."""

    opcode: str  # e.g. "ld.global.nc.f32"
    operands: tuple[str, ...]
    guard: str | None = None  # "%p1" or "!%p1"
    line: int = 0  # 1-based line in the PTX text
    src_line: int | None = None  # from the closest preceding .loc, if any
    src_file: int | None = None  # that .loc's file number (PtxModule.files)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.opcode.split("."))

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def state_space(self) -> str | None:
        """``global``/``shared``/... for memory instructions, ``"generic"`` when none is named."""
        for part in self.parts[1:]:
            name = part.split("::", 1)[0]
            if name in STATE_SPACES:
                return name
        return "generic"

    @property
    def access_width(self) -> int:
        """Bytes touched by a load/store/atomic (vector count x element size)."""
        vec = 1
        size = 0
        for part in self.parts[1:]:
            if re.fullmatch(r"v\d+", part):
                vec = int(part[1:])
            elif part in _SIZE_OF_TYPE:
                size = _SIZE_OF_TYPE[part]
        return max(1, vec * (size or 1))

    @property
    def is_64bit(self) -> bool:
        return any(p in ("u64", "s64", "b64") for p in self.parts[1:])

    def text(self) -> str:
        guard = f"@{self.guard} " if self.guard else ""
        ops = ", ".join(self.operands)
        return f"{guard}{self.opcode}\t{ops};" if ops else f"{guard}{self.opcode};"


@dataclass(frozen=True)
class Statement:
    """One statement of an entry body, in order.

    ``kind`` is ``instr`` (with ``instr`` set), ``label`` (``text`` is the label name),
    ``decl`` (``.reg``, ``.shared``, ``.local`` ... declarations), ``pragma`` (``.pragma``,
    ends with ``;``), ``directive`` (``.loc``/``.file``: one line, no ``;``), ``open`` /
    ``close`` (a nested ``{`` / ``}`` scope).
    """

    kind: str
    text: str
    line: int
    instr: Instruction | None = None
    depth: int = 0

    def render(self) -> str:
        if self.kind == "instr" and self.instr is not None:
            return "\t" + self.instr.text()
        if self.kind == "label":
            return f"{self.text}:"
        if self.kind in ("decl", "pragma"):
            return f"\t{self.text};"
        if self.kind == "directive":
            return f"\t{self.text}"
        return "\t" + self.text


@dataclass
class Entry:
    """A ``.entry`` (kernel) or ``.func`` (device function) of a module."""

    name: str
    kind: str  # "entry" | "func"
    linkage: str  # e.g. ".visible" / ".weak" / ""
    params: list[Param]
    performance_directives: str  # text between ")" and "{" (.maxntid, .reqntid ...)
    body: list[Statement]
    line: int  # line of the declaration
    return_decl: str = ""  # ".func (.param .b32 r)" part
    source_names: dict[str, str] = field(default_factory=dict)  # param -> user's name

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def display_name(self, param: str) -> str:
        """The name the user wrote for a parameter (``y``), falling back to the PTX name;
        a field of a by-value struct keeps its byte offset (``batch@120``)."""
        if param in self.source_names:
            return self.source_names[param]
        struct, at, offset = param.partition("@")
        if at and struct in self.source_names:
            return f"{self.source_names[struct]}@{offset}"
        return param

    @property
    def instructions(self) -> list[Instruction]:
        return [s.instr for s in self.body if s.instr is not None]


@dataclass(frozen=True)
class Declaration:
    """A function declared at module scope without a body (``.extern .func (.param .b32
    r) f (.param .b32 x);``): defined in another module the linker brings in.
    ``text[start:end]`` of the module is the whole declaration, ``;`` included."""

    name: str
    linkage: str
    return_decl: str
    params: tuple[Param, ...]
    start: int
    end: int


@dataclass
class PtxModule:
    """A parsed PTX module: header, module-scope chunks and entries, in text order."""

    text: str
    version: str
    target: str
    address_size: int
    chunks: list[str | Entry]  # raw module-level text or an entry, in order
    module_vars: dict[str, str]  # module-scope variable -> state space ("global", "shared"..)
    files: dict[int, str] = field(default_factory=dict)  # .file number -> source path
    declarations: list[Declaration] = field(default_factory=list)  # bodiless functions

    @property
    def entries(self) -> list[Entry]:
        return [c for c in self.chunks if isinstance(c, Entry) and c.kind == "entry"]

    @property
    def functions(self) -> list[Entry]:
        return [c for c in self.chunks if isinstance(c, Entry) and c.kind == "func"]

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        names = ", ".join(e.name for e in self.entries) or "none"
        raise KernelError(
            "no-such-kernel", f"kernel {name!r} is not in this PTX (entries: {names})", step="parse"
        )

    def render(self, replacements: dict[str, str] | None = None) -> str:
        """Text of the module; ``replacements`` maps an entry name to its new text."""
        out: list[str] = []
        for chunk in self.chunks:
            if isinstance(chunk, Entry):
                if replacements and chunk.name in replacements:
                    out.append(replacements[chunk.name])
                else:
                    out.append(render_entry(chunk))
            else:
                out.append(chunk)
        return "".join(out)


# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DECL_START = re.compile(
    r"(?P<linkage>(?:\.(?:visible|weak|extern|common)\s+)*)\.(?P<kind>entry|func)\b", re.S
)
_PARAM = re.compile(
    r"\.param\s+(?P<attrs>(?:\.(?:align\s+\d+|ptr|global|shared|const|local|u64|u32|b64|b32|s64|"
    r"s32|f64|f32|f16|bf16|u16|s16|b16|u8|s8|b8|pred)\s*)+)\s*(?P<name>[\w$%.]+)"
    r"\s*(?:\[(?P<n>\d*)\])?",
    re.S,
)
_LABEL = re.compile(r"^([$%\w.]+)\s*:")
_MODULE_VAR = re.compile(
    r"^\s*(?:\.(?:visible|weak|extern|common)\s+)*\.(?P<space>global|shared|const)\b[^;]*?"
    r"(?P<name>[A-Za-z_$%][\w$%]*)\s*(?:\[[^\]]*\])*\s*(?:=[^;]*)?;",
    re.M,
)


def _blank_comments(text: str) -> str:
    """Replace comments with spaces, keeping every newline so line numbers stay right."""
    return _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def split_top_level(text: str, opening: str = "[{(", closing: str = "]})") -> list[str]:
    """``text`` cut at the commas outside any bracket, each piece stripped (an empty
    last piece dropped)."""
    out: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        out.append(tail)
    return out


def split_operands(text: str) -> tuple[str, ...]:
    """Split ``a, [b+4], {c, d}`` at top-level commas."""
    return tuple(split_top_level(text))


def parse_instruction(
    text: str, line: int, src_line: int | None = None, src_file: int | None = None
) -> Instruction:
    text = " ".join(text.split())
    guard = None
    m = re.match(r"@(!?[%\w$]+)\s+", text)
    if m:
        guard = m.group(1)
        text = text[m.end() :]
    parts = text.split(None, 1)
    opcode = parts[0]
    operands = split_operands(parts[1]) if len(parts) > 1 else ()
    return Instruction(opcode, operands, guard, line, src_line, src_file)


def _parse_params(text: str, where: int) -> list[Param]:
    params: list[Param] = []
    for piece in split_operands(text):
        m = _PARAM.fullmatch(piece.strip())
        if not m:
            raise KernelError("bad-ptx", f"cannot read parameter {piece!r}", step=f"parse:{where}")
        attrs = m.group("attrs").split()
        align = 0
        typ = ""
        for i, a in enumerate(attrs):
            if a == ".align" and i + 1 < len(attrs):
                align = int(attrs[i + 1])
            elif a.startswith(".") and a[1:] in _SIZE_OF_TYPE:
                typ = a[1:]
        if not typ:
            raise KernelError("bad-ptx", f"parameter without a type: {piece!r}", step="parse")
        n = m.group("n")
        count = int(n) if n else None
        size = _SIZE_OF_TYPE[typ] * (count or 1)
        params.append(Param(m.group("name"), typ, size, align or _SIZE_OF_TYPE[typ], count))
    return params


def return_params(return_decl: str) -> list[Param]:
    """The values a function returns, from its ``(.param .b32 func_retval0)`` part."""
    inner = return_decl.strip()
    if not (inner.startswith("(") and inner.endswith(")")) or not inner[1:-1].strip():
        return []
    return _parse_params(inner[1:-1], 0)


def find_matching(
    text: str, start: int, open_ch: str, close_ch: str, limit: int | None = None
) -> int:
    """The index of the ``close_ch`` that closes the ``open_ch`` at ``start`` (looking at
    most ``limit`` characters on), or -1."""
    depth = 0
    end = len(text) if limit is None else min(len(text), start + limit)
    for i in range(start, end):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    return -1


def _match_paren(text: str, start: int, open_ch: str, close_ch: str) -> int:
    found = find_matching(text, start, open_ch, close_ch)
    if found < 0:
        raise KernelError("bad-ptx", f"unbalanced {open_ch!r}", step="parse")
    return found


def _parse_body(text: str, offset: int, full: str) -> list[Statement]:
    """Statements of a body; ``offset`` is the body's position in ``full`` (for lines)."""
    stmts: list[Statement] = []
    i = 0
    n = len(text)
    depth = 0
    src_line: int | None = None
    src_file: int | None = None
    line_at = full.count("\n", 0, offset) + 1
    last_pos = 0

    def line_of(pos: int) -> int:
        nonlocal line_at, last_pos
        line_at += text.count("\n", last_pos, pos)
        last_pos = pos
        return line_at

    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        line = line_of(i)
        if ch == "{":
            depth += 1
            stmts.append(Statement("open", "{", line, depth=depth))
            i += 1
            continue
        if ch == "}":
            stmts.append(Statement("close", "}", line, depth=depth))
            depth -= 1
            i += 1
            continue
        rest = text[i : i + 200]
        if rest.startswith((".loc", ".file")):
            end = text.find("\n", i)
            end = n if end < 0 else end
            directive = text[i:end].strip()
            if directive.startswith(".loc"):
                bits = directive.split()
                # Code inlined from a helper (a toolkit header's atomicAdd, say) is
                # reported where the kernel calls it: ".loc 2 112 3, ..., inlined_at 1 32 3".
                call = re.search(r"inlined_at\s+(\d+)\s+(\d+)", directive)
                if call:
                    src_file, src_line = int(call.group(1)), int(call.group(2))
                elif len(bits) >= 3 and bits[2].isdigit():
                    src_line = int(bits[2].rstrip(","))
                    src_file = int(bits[1]) if bits[1].isdigit() else None
            stmts.append(Statement("directive", directive, line, depth=depth))
            i = end
            continue
        m = _LABEL.match(rest)
        if m:
            stmts.append(Statement("label", m.group(1), line, depth=depth))
            i += m.end()
            continue
        end = text.find(";", i)
        if end < 0:
            raise KernelError("bad-ptx", f"statement without ';' at line {line}", step="parse")
        stmt = " ".join(text[i:end].split())
        i = end + 1
        if stmt.startswith("."):
            kind = "pragma" if stmt.startswith((".pragma", ".section")) else "decl"
            stmts.append(Statement(kind, stmt, line, depth=depth))
        else:
            ins = parse_instruction(stmt, line, src_line, src_file)
            stmts.append(Statement("instr", stmt, line, instr=ins, depth=depth))
    return stmts


def _skip_space(text: str, j: int) -> int:
    while j < len(text) and text[j].isspace():
        j += 1
    return j


def _parse_head(clean: str, kind: str, after: int) -> tuple[str, str, list[Param], int]:
    """``(name, return list, parameters, end)`` of the head of an entry or function whose
    ``.entry``/``.func`` ends at ``after``: ``.func (.param .b32 r) name (params)``."""
    return_decl = ""
    j = _skip_space(clean, after)
    if kind == "func" and j < len(clean) and clean[j] == "(":
        close = _match_paren(clean, j, "(", ")")
        return_decl = clean[j : close + 1]
        j = close + 1
    name_m = re.compile(r"\s*([\w$%.]+)").match(clean, j)
    if not name_m:
        raise KernelError("bad-ptx", "entry without a name", step="parse")
    j = _skip_space(clean, name_m.end())
    params: list[Param] = []
    if j < len(clean) and clean[j] == "(":
        close = _match_paren(clean, j, "(", ")")
        params = _parse_params(clean[j + 1 : close], clean.count("\n", 0, j) + 1)
        j = close + 1
    return name_m.group(1), return_decl, params, j


def _module_vars(chunks: list[str | Entry]) -> dict[str, str]:
    """Module-scope variables declared in the text between entries -> state space."""
    module_vars: dict[str, str] = {}
    for chunk in chunks:
        if isinstance(chunk, str):
            for vm in _MODULE_VAR.finditer(_blank_comments(chunk)):
                module_vars[vm.group("name")] = vm.group("space")
    return module_vars


def parse_ptx(text: str) -> PtxModule:
    """Parse a PTX module. Raises :class:`KernelError` (code ``bad-ptx``) on malformed text."""
    clean = _blank_comments(text)
    version = re.search(r"^\s*\.version\s+([\d.]+)", clean, re.M)
    target = re.search(r"^\s*\.target\s+([^\n]+)", clean, re.M)
    addr = re.search(r"^\s*\.address_size\s+(\d+)", clean, re.M)
    if not version or not target:
        raise KernelError("bad-ptx", "not PTX: no .version/.target directive found", step="parse")
    chunks: list[str | Entry] = []
    declarations: list[Declaration] = []
    pos = 0
    for m in _DECL_START.finditer(clean):
        if m.start() < pos:
            continue  # inside an entry we already consumed
        prefix_start = m.start()
        name, return_decl, params, head_end = _parse_head(clean, m.group("kind"), m.end())
        brace = clean.find("{", head_end)
        semi = clean.find(";", head_end)
        # A prototype (".extern .func f(...);") has a ';' before any '{'.
        if brace < 0 or (0 <= semi < brace):
            if semi >= 0 and m.group("kind") == "func":  # it stays in the raw text
                linkage = m.group("linkage").strip()
                declarations.append(
                    Declaration(name, linkage, return_decl, tuple(params), prefix_start, semi + 1)
                )
            continue
        perf = clean[head_end:brace].strip()
        body_end = _match_paren(clean, brace, "{", "}")
        chunks.append(text[pos:prefix_start])
        body = _parse_body(clean[brace + 1 : body_end], brace + 1, clean)
        entry = Entry(
            name=name,
            kind=m.group("kind"),
            linkage=m.group("linkage").strip(),
            params=params,
            performance_directives=perf,
            body=body,
            line=clean.count("\n", 0, prefix_start) + 1,
            return_decl=return_decl,
        )
        chunks.append(entry)
        pos = body_end + 1
    chunks.append(text[pos:])
    return PtxModule(
        text=text,
        version=version.group(1),
        target=target.group(1).strip(),
        address_size=int(addr.group(1)) if addr else 64,
        chunks=chunks,
        module_vars=_module_vars(chunks),
        files={
            int(m.group(1)): m.group(2)
            for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', clean, re.M)
        },
        declarations=declarations,
    )


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


def render_param(p: Param) -> str:
    if p.array is not None:
        return f"\t.param .align {p.align} .{p.type} {p.name}[{p.array}]"
    return f"\t.param .{p.type} {p.name}"


def render_entry(
    entry: Entry, body_lines: list[str] | None = None, params: list[Param] | None = None
) -> str:
    """Text of an entry; ``body_lines``/``params`` replace the parsed ones when given."""
    ps = entry.params if params is None else params
    head = f"{entry.linkage} .{entry.kind} " if entry.linkage else f".{entry.kind} "
    if entry.return_decl:
        head += entry.return_decl + " "
    head += entry.name
    head += "(\n" + ",\n".join(render_param(p) for p in ps) + "\n)" if ps else "()"
    if entry.performance_directives:
        head += "\n" + entry.performance_directives
    lines = body_lines if body_lines is not None else [s.render() for s in entry.body]
    return head + "\n{\n" + "\n".join(lines) + "\n}\n"


def set_version(ptx: str, version: str) -> str:
    """Return ``ptx`` with its ``.version`` directive replaced (used to lower it at launch)."""
    return re.sub(
        r"^(\s*)\.version\s+[\d.]+", rf"\g<1>.version {version}", ptx, count=1, flags=re.M
    )
