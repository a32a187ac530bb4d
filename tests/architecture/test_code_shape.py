"""The package's code stays readable: inside ``gpushare_ext/`` no function, method or
class above cyclomatic complexity 20 (radon), no module over 800 lines, no class over 500
lines, and no block of more than 10 lines written twice.  Each check has a test of its
own that it finds what it is meant to find."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from radon.complexity import cc_visit

PACKAGE = Path(__file__).resolve().parents[2] / "gpushare_ext"
MAX_COMPLEXITY = 20
# Still above the line, each with what will bring it down.
KNOWN_COMPLEX: dict[str, str] = {}
REPEAT_LINES = 11  # a block of more than 10 lines
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 500


def complexities() -> dict[str, int]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for block in cc_visit(path.read_text()):
            name = f"{path.relative_to(PACKAGE)}:{getattr(block, 'fullname', block.name)}"
            found[name] = block.complexity
    return found


def test_no_function_is_too_complex():
    too_complex = {
        name: value
        for name, value in complexities().items()
        if value > MAX_COMPLEXITY and name not in KNOWN_COMPLEX
    }
    assert not too_complex, too_complex


def test_the_known_complex_functions_are_still_there():
    found = complexities()
    for name in KNOWN_COMPLEX:
        assert found.get(name, 0) > MAX_COMPLEXITY, f"{name} is simpler now: drop it from the list"


def repeated_blocks(root: Path = PACKAGE) -> list[list[tuple[str, int]]]:
    """Windows of REPEAT_LINES non-blank, non-comment lines that occur more than once."""
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path in root.rglob("*.py"):
        numbered = [
            (number, line.strip())
            for number, line in enumerate(path.read_text().splitlines(), start=1)
            if line.strip() and not line.strip().startswith("#")
        ]
        for k in range(len(numbered) - REPEAT_LINES + 1):
            window = tuple(text for _, text in numbered[k : k + REPEAT_LINES])
            if sum(map(len, window)) >= 200:  # runs of brackets and short keywords are not code
                seen[window].append((str(path.relative_to(root)), numbered[k][0]))
    return [places for places in seen.values() if len(places) > 1]


def test_no_block_of_more_than_ten_lines_is_written_twice():
    repeated = repeated_blocks()
    assert not repeated, "\n".join(", ".join(f"{f}:{n}" for f, n in r) for r in repeated[:10])


def test_a_block_written_twice_is_found(tmp_path: Path):
    body = "".join(
        f"    total_{i} = compute_something(argument_{i}, other_value_{i})\n" for i in range(12)
    )
    (tmp_path / "a.py").write_text("def one():\n" + body)
    (tmp_path / "b.py").write_text("# the same again\ndef two():\n" + body)
    found = repeated_blocks(tmp_path)
    assert found and {f for f, _ in found[0]} == {"a.py", "b.py"}


def long_modules(root: Path = PACKAGE) -> dict[str, int]:
    """Modules over MAX_MODULE_LINES lines -> their length."""
    found = {}
    for path in root.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            found[str(path.relative_to(root))] = lines
    return found


def long_classes(root: Path = PACKAGE) -> dict[str, int]:
    """Classes over MAX_CLASS_LINES lines, nested ones too -> their length."""
    found = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    found[f"{path.relative_to(root)}:{node.name}"] = lines
    return found


def test_no_module_is_over_800_lines():
    assert not long_modules(), long_modules()


def test_a_module_over_800_lines_is_found(tmp_path: Path):
    (tmp_path / "long.py").write_text("value = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("value = 1\n" * MAX_MODULE_LINES)
    assert long_modules(tmp_path) == {"long.py": MAX_MODULE_LINES + 1}


def test_no_class_is_over_500_lines():
    assert not long_classes(), long_classes()


def test_a_class_over_500_lines_is_found(tmp_path: Path):
    def class_of(name: str, body_lines: int) -> str:
        return f"class {name}:\n" + "".join(f"    a_{i} = {i}\n" for i in range(body_lines))

    (tmp_path / "classes.py").write_text(
        class_of("Long", MAX_CLASS_LINES) + "\n\n" + class_of("Fits", MAX_CLASS_LINES - 1)
    )
    assert long_classes(tmp_path) == {"classes.py:Long": MAX_CLASS_LINES + 1}
