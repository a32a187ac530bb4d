"""Host code set aside, for files whose device code compiles but whose host code does not.

What it is for: a program written for an older CUDA (``cudaThreadSynchronize``, fields
``cudaDeviceProp`` no longer has) or for libraries this host lacks fails to compile as a
whole, although its kernels are fine: only the kernels matter to the analysis.
:func:`without_host_bodies` empties the bodies of the functions that run only on the
host (lines kept, so every line keeps its number), and :func:`includers` finds the files
that ``#include`` a file meant to be included, so that an error can name the file to
classify instead.

What it must not do: change device code (``__global__``, ``__device__``, ``__host__
__device__`` functions, declarations, types, variables) or anything outside a host
function's braces; it is a text transformation, and never runs a compiler.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["includers", "without_host_bodies"]

_DEVICE_WORDS = re.compile(r"\b(__global__|__device__)\b|__attribute__\s*\(\(\s*(global|device)")
_NOT_A_FUNCTION = re.compile(r"\b(struct|class|union|enum|namespace|typedef)\b|=")
_SCOPE_HEAD = re.compile(r"^\s*(?:inline\s+)?namespace\b[^{]*$|^\s*extern\s*\"C\"\s*$")
_SEARCH_SUFFIXES = {".cu", ".cuh", ".c", ".cc", ".cpp", ".cxx", ".h", ".hpp"}
_MAX_SEARCHED = 400


def _skip_literal(text: str, i: int) -> int:
    """The index after the string or character literal starting at ``i``."""
    quote = text[i]
    j = i + 1
    while j < len(text) and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _skip_directive(text: str, i: int) -> int:
    """The index after the preprocessor line starting at ``i`` (continuations included)."""
    while True:
        end = text.find("\n", i)
        if end < 0:
            return len(text)
        if text[end - 1] != "\\":
            return end
        i = end + 1


def _matching_brace(text: str, i: int) -> int:
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch in "\"'":
            j = _skip_literal(text, j)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return -1


def _is_host_function(head: str) -> bool:
    head = head.strip()
    if not head.endswith(")") and not re.search(
        r"\)\s*(const|noexcept|override|final|->.*)$", head
    ):
        return False
    if "(" not in head or _NOT_A_FUNCTION.search(head.split("(", 1)[0]):
        return False
    return not _DEVICE_WORDS.search(head)


def without_host_bodies(text: str) -> str:
    """``text`` (comments already blanked) with every host-only function body emptied;
    returns ``text`` itself when it has none."""
    bodies: list[tuple[int, int]] = []  # (first, last) character inside the braces
    i = 0
    head_start = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":
            i = _skip_literal(text, i)
            continue
        if ch == "#" and text[text.rfind("\n", 0, i) + 1 : i].strip() == "":
            i = _skip_directive(text, i)
            head_start = i
            continue
        if ch in ";}":
            head_start = i + 1
        elif ch == "{":
            head = text[head_start:i]
            if _SCOPE_HEAD.match(head.strip()):
                head_start = i + 1  # a namespace or extern "C" block: look inside it
            else:
                close = _matching_brace(text, i)
                if close < 0:
                    break
                if _is_host_function(head):
                    bodies.append((i + 1, close))
                # A type, an initialiser or a device function is kept as it is.
                i = close
                head_start = close + 1
                continue
        i += 1
    if not bodies:
        return text
    pieces = []
    last = 0
    for first, end in bodies:
        pieces.append(text[last:first])
        pieces.append(re.sub(r"[^\n]", " ", text[first:end]))
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


def includers(path: Path) -> list[Path]:
    """Files next to ``path`` or one folder up that ``#include`` it by name."""
    pattern = re.compile(r'^\s*#\s*include\s*"(?:[^"]*/)?' + re.escape(path.name) + '"', re.M)
    found: list[Path] = []
    searched = 0
    folders = [path.parent, path.parent.parent]
    for folder in dict.fromkeys(folders):
        try:
            candidates = (
                sorted(folder.rglob("*")) if folder == path.parent else sorted(folder.iterdir())
            )
        except OSError:
            continue
        for candidate in candidates:
            if searched >= _MAX_SEARCHED:
                return found
            if candidate.suffix.lower() not in _SEARCH_SUFFIXES or candidate == path:
                continue
            searched += 1
            try:
                if candidate.stat().st_size > 2_000_000:
                    continue
                if pattern.search(candidate.read_text(errors="replace")):
                    found.append(candidate)
            except OSError:
                continue
    return found
