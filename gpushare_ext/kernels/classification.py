"""The verdict: idempotent, non-idempotent or unknown, with reasons a user can read.

What it is for: turning what the analysis found (a ``KernelReport``: buffers, accesses,
grid-wide synchronisation, what the transform refuses) into a ``Classification``
(:func:`classify`), and settling aliasing at launch from the buffers actually passed
(:func:`classify_launch`).

What it must not do: look at PTX instructions beyond the accesses it is given, rewrite
PTX or touch CUDA.  It over-approximates where it must: a write it cannot attribute
makes the kernel *unknown*, never *idempotent*.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpushare_ext.kernels.ptx import Instruction, PtxModule
from gpushare_ext.kernels.report import (
    Access,
    BufferUse,
    Classification,
    Idempotence,
    KernelReport,
    MemoryAccess,
)

__all__ = ["NON_IDEMPOTENT_ATOMICS", "atomic_op", "classify", "classify_launch"]

NON_IDEMPOTENT_ATOMICS = {"add", "inc", "dec", "cas", "exch", "sub"}


def atomic_op(ins: Instruction) -> str:
    for p in ins.parts[1:]:
        if p in ("add", "inc", "dec", "cas", "exch", "sub", "max", "min", "and", "or", "xor"):
            return p
    return "?"


def _folded(items: list[MemoryAccess], one: str, many: str) -> str:
    """One reason for accesses of one kind: the first in full, the rest counted."""
    first = items[0]
    if len(items) == 1:
        return one.format(kind=first.kind, where=first.where)
    kinds = {a.kind for a in items}
    noun = f"{first.kind}s" if len(kinds) == 1 else "accesses"
    return many.format(count=len(items), kinds=noun, where=first.where)


def _unknown_reasons(report: KernelReport) -> list[str]:
    """Why the analysis cannot tell, folded: one reason per kind of cause."""
    loaded = [a for a in report.accesses if a.origin == "loaded"]
    unattributed = [a for a in report.accesses if a.origin == "unknown"]
    module_writes = [
        a for a in report.accesses if a.origin.startswith("module-var:") and a.kind != "read"
    ]
    reasons = []
    if loaded:
        reasons.append(
            _folded(
                loaded,
                "{kind} through a pointer loaded from memory at {where}: its buffer is not a "
                "parameter",
                "{count} {kinds} through pointers loaded from memory, e.g. at {where}: their "
                "buffers are not parameters",
            )
        )
    if unattributed:
        reasons.append(
            _folded(
                unattributed,
                "{kind} at {where} whose address the analysis cannot attribute",
                "{count} {kinds} whose address the analysis cannot attribute, e.g. at {where}",
            )
        )
    for a in module_writes:
        reasons.append(f"{a.kind} to the module variable {a.origin.split(':', 1)[1]} at {a.where}")
    textures = [u for u in report.unsupported if u.startswith("texture/surface instruction at ")]
    if len(textures) > 1:
        first = textures[0].removeprefix("texture/surface instruction at ")
        reasons.append(f"{len(textures)} texture/surface instructions, e.g. at {first}")
    else:
        reasons += textures
    reasons += [u for u in report.unsupported if u not in textures]
    return reasons


def _rerun_hazards(b: BufferUse) -> list[str]:
    """Why a buffer that is read and written makes a re-run unsafe: a read of what the
    first run overwrote, and the first atomic that reads and updates it."""
    name = f"`{b.display}`"
    found: list[str] = []
    hazards = b.hazard_reads
    if hazards and (b.writes or b.atomics):
        w = (b.writes or b.atomics)[0]
        more = len(hazards) - 1
        also = f" and {more} more read{'s' if more != 1 else ''}" if more else ""
        found.append(
            f"parameter {name} is read at {hazards[0].where}{also} and written at "
            f"{w.where}: a re-run would read values the first run already overwrote"
        )
    for a in b.atomics:
        op = atomic_op(a.instr)
        if op in NON_IDEMPOTENT_ATOMICS:
            found.append(
                f"atomic {op} on parameter {name} at {a.where} reads and updates it: "
                "a re-run would apply it twice"
            )
            break
    return found


def _why_rerun_is_safe(b: BufferUse) -> str | None:
    """What makes this buffer's use safe to run again, or None for an unused one."""
    if b.access is Access.READ:
        return f"parameter `{b.display}` is only read"
    if b.access is Access.WRITTEN and b.own_reads:
        return (
            f"parameter `{b.display}` is written, and read only where the same thread "
            f"wrote it first (at {b.own_reads[0].where}): a re-run reads its own values "
            "there, so that is no re-run hazard"
        )
    if b.access is Access.WRITTEN:
        how = " (replay-safe atomics)" if b.atomics and not b.writes else ""
        return f"parameter `{b.display}` is only written{how}"
    return None


def classify(report: KernelReport, module: PtxModule) -> Classification:
    unknown = _unknown_reasons(report)
    non: list[str] = []
    for b in report.buffers.values():
        if b.access is Access.READ_WRITTEN:
            non += _rerun_hazards(b)
    if report.grid_sync:
        non.append("blocks communicate (" + "; ".join(report.grid_sync[:2]) + ")")
    if unknown:
        return Classification(Idempotence.UNKNOWN, tuple(dict.fromkeys(unknown + non)))
    if non:
        return Classification(Idempotence.NON_IDEMPOTENT, tuple(dict.fromkeys(non)))
    reasons = [r for r in map(_why_rerun_is_safe, report.buffers.values()) if r is not None]
    if not reasons:
        reasons.append("the kernel touches no global memory through its parameters")
    return Classification(Idempotence.IDEMPOTENT, tuple(reasons))


# ---------------------------------------------------------------------------------------
# Launch-time aliasing
# ---------------------------------------------------------------------------------------


def _overlap(extent_a: tuple[int, int], extent_b: tuple[int, int]) -> bool:
    """Whether two (address, nbytes) extents share a byte."""
    pa, na = extent_a
    pb, nb = extent_b
    return not (na == 0 or nb == 0 or pa + na <= pb or pb + nb <= pa)


def _aliasing_reason(a: BufferUse, b: BufferUse) -> str | None:
    """Why two overlapping buffers make a launch non-idempotent, or None when they do not
    (both only read)."""
    reader = a if a.access is Access.READ else b if b.access is Access.READ else None
    writer = b if reader is a else a if reader is b else None
    if reader is not None and writer is not None and writer.is_written:
        return (
            f"parameters `{reader.display}` and `{writer.display}` overlap in memory: "
            f"`{reader.display}` is read and `{writer.display}` is written, so this "
            "launch updates a buffer in place"
        )
    if a.is_written and b.is_written:
        return f"parameters `{a.display}` and `{b.display}` overlap in memory and both are written"
    return None


def classify_launch(report: KernelReport, extents: Mapping[str, tuple[int, int]]) -> Classification:
    """Re-classify with the actual buffers: ``extents`` maps param -> (address, nbytes).

    Two parameters whose extents overlap are one buffer: if one is read and the other is
    written, the kernel is not idempotent for this launch.
    """
    base = report.classification
    if base.verdict is not Idempotence.IDEMPOTENT:
        return base
    uses = [
        b for b in report.buffers.values() if b.param in extents and b.access is not Access.NONE
    ]
    reasons: list[str] = []
    for i, a in enumerate(uses):
        for b in uses[i + 1 :]:
            if not _overlap(extents[a.param], extents[b.param]):
                continue
            reason = _aliasing_reason(a, b)
            if reason is not None:
                reasons.append(reason)
    if reasons:
        return Classification(Idempotence.NON_IDEMPOTENT, tuple(reasons))
    return base
