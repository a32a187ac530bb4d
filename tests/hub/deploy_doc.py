"""docs/deploy.md's walkthrough "1. On one machine, without systemd", read as code.

What it is for: the hub test runs that section's fenced code blocks in order, as the page
writes them.  This module finds them, tells which step each belongs to (the bold
``**N. ...**`` paragraph before it; the variables before step 1 are step 0), finds the
inline commands the test also runs, and puts the test's own paths and ports where the
page writes the admin's, failing with one line when a text it was told to replace is no
longer on the page: the page and the test cannot part ways unnoticed.

What it must not do: run anything, touch the host or need root (tests/deploy reads the
real page with it on any machine).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

DEPLOY_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
SECTION_HEADING = "## 1. On one machine, without systemd"
STEP_HEADING = re.compile(r"^\*\*(\d+)\.\s+(.+?)\*\*", re.MULTILINE)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# What the walkthrough is written in; a block of any other kind is a change of the page
# the test would otherwise skip without a word.
LANGUAGES = ("bash", "python")
VARIABLES_STEP = 0
VARIABLES_TITLE = "the variables"


class DocDrift(AssertionError):
    """docs/deploy.md no longer writes what the hub test runs or replaces."""


@dataclass(frozen=True)
class Block:
    """One piece of the walkthrough's code: a fenced block, or an inline command."""

    step: int
    title: str
    language: str  # "bash", "python", or "inline" for a command in a step's prose
    text: str

    @property
    def name(self) -> str:
        """How a failure names it: ``step 8 (The system broker, as root)``."""
        return f"step {self.step} ({self.title})"

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


@dataclass(frozen=True)
class Walkthrough:
    """The section's fenced code blocks in page order, and each step's prose."""

    blocks: tuple[Block, ...]
    titles: dict[int, str]
    prose: dict[int, str]  # each step's text with its fenced blocks taken out

    @property
    def steps(self) -> list[int]:
        """The numbered steps, in page order (step 0, the variables, is not one)."""
        return [step for step in self.titles if step != VARIABLES_STEP]

    def blocks_of(self, step: int, language: str | None = None) -> list[Block]:
        return [
            block
            for block in self.blocks
            if block.step == step and (language is None or block.language == language)
        ]

    def inline_command(self, step: int, lead_in: str) -> Block:
        """The inline code right after ``lead_in`` in the step's prose, e.g. the
        command after "Check it as any user: "."""
        pattern = re.escape(lead_in) + r"`([^`]+)`"
        found = re.search(pattern, self.prose.get(step, ""))
        if found is None:
            raise DocDrift(
                f"docs/deploy.md: step {step} no longer has an inline command after {lead_in!r}"
            )
        return Block(step=step, title=self.titles[step], language="inline", text=found[1])


def section_text(page: str) -> str:
    """The walkthrough: from the section's heading to the next heading ("### What the
    end-to-end test checks" says what the test does; it is no step of the admin's)."""
    start = page.find(SECTION_HEADING + "\n")
    if start < 0:
        raise DocDrift(f"docs/deploy.md has no section {SECTION_HEADING!r}")
    rest = page[start + len(SECTION_HEADING) :]
    end = re.search(r"^#{2,3} ", rest, re.MULTILINE)
    return rest if end is None else rest[: end.start()]


def read_walkthrough(page: str | None = None) -> Walkthrough:
    """The walkthrough of ``page`` (docs/deploy.md's text when None)."""
    text = section_text(DEPLOY_GUIDE.read_text() if page is None else page)
    headings = [
        (m.start(), int(m[1]), m[2].strip().rstrip(".")) for m in STEP_HEADING.finditer(text)
    ]
    titles: dict[int, str] = {VARIABLES_STEP: VARIABLES_TITLE}
    for _, step, title in headings:
        if step in titles:
            raise DocDrift(f"docs/deploy.md: step {step} is written twice")
        titles[step] = title

    def step_at(offset: int) -> int:
        before = [step for start, step, _ in headings if start < offset]
        return before[-1] if before else VARIABLES_STEP

    blocks: list[Block] = []
    for fence in FENCE.finditer(text):
        step = step_at(fence.start())
        if fence[1] not in LANGUAGES:
            raise DocDrift(
                f"docs/deploy.md: step {step} has a ```{fence[1]} block; the walkthrough's "
                f"blocks are {' or '.join(LANGUAGES)}"
            )
        blocks.append(Block(step=step, title=titles[step], language=fence[1], text=fence[2]))
    return Walkthrough(blocks=tuple(blocks), titles=titles, prose=_prose_by_heading(text))


def _prose_by_heading(text: str) -> dict[int, str]:
    """Each step's text from its heading to the next one, without the fenced blocks."""
    without_code = FENCE.sub("", text)
    prose: dict[int, str] = {}
    marks = list(STEP_HEADING.finditer(without_code))
    prose[VARIABLES_STEP] = without_code[: marks[0].start()] if marks else without_code
    for index, mark in enumerate(marks):
        end = marks[index + 1].start() if index + 1 < len(marks) else len(without_code)
        prose[int(mark[1])] = without_code[mark.start() : end]
    return prose


@dataclass(frozen=True)
class Substitution:
    """In ``step``'s code, put ``ours`` where the page writes ``written``."""

    step: int
    written: str
    ours: str


def substitute(blocks: Sequence[Block], substitutions: Iterable[Substitution]) -> list[Block]:
    """``blocks`` with every substitution made in each block of its step that writes it;
    DocDrift, naming the step, for a substitution that no block of its step writes."""
    result = list(blocks)
    for substitution in substitutions:
        found = False
        for index, block in enumerate(result):
            if block.step == substitution.step and substitution.written in block.text:
                found = True
                text = block.text.replace(substitution.written, substitution.ours)
                result[index] = replace(block, text=text)
        if not found:
            title = next((b.title for b in blocks if b.step == substitution.step), "?")
            raise DocDrift(
                f"docs/deploy.md step {substitution.step} ({title}) no longer writes "
                f"{substitution.written!r}, which the hub test replaces"
            )
    return result
