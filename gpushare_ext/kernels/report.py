"""What the analysis says about one kernel: its buffers, accesses and classification.

What it is for: the types every stage after the analysis reads (:class:`KernelReport`
and its parts: :class:`ControlFlow`, :class:`MemoryAccess`, :class:`BufferUse`,
:class:`Classification`), so that the transform, the launcher and the CLI depend on
what was found, not on how it was found.

What it must not do: analyse anything (``analysis.py`` fills these in), rewrite PTX or
touch CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gpushare_ext.kernels.ptx import Entry, Instruction
from gpushare_ext.kernels.signatures import kernel_name

__all__ = [
    "Access",
    "BufferUse",
    "Classification",
    "ControlFlow",
    "Idempotence",
    "KernelReport",
    "MemoryAccess",
]


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
