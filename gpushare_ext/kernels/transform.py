"""PTX rewrites: persistent preemptible blocks, back-edge abort checks, address fences.

What it is for: turning one kernel entry into a *preemptible* kernel the launcher
(``launch.py``) can stop and continue. The rewrite is a named pipeline of passes (one
class per pass, each with a name and a declared effect), text in and text out, so every
step is tested on PTX files without a GPU and a failure names the step that failed.

The scheme (documented for users in ``docs/kernels.md``):

* The launch starts at most K *persistent* blocks. Each loops over *chunks*: its leader
  thread (thread 0,0,0) first reads the session's yield flag (device memory,
  ``ld.volatile``). If the flag is clear it claims the next ``chunk`` consecutive
  *logical block ids* with one ``atom.add`` of ``chunk`` on the progress record's counter;
  if set it claims nothing. It publishes the chunk's base (or "stop") through shared
  memory (two slots used alternately), ``barrier.sync``; every thread reads it, so the
  exit is block-uniform. The block then runs the ids ``[base, min(base + chunk, stop))``
  back to back; ``chunk`` is a kernel parameter chosen per launch (``launch.py``).
* The logical id replaces ``%ctaid.x/y/z`` (decomposed with the original grid dims,
  extra parameters that also replace ``%nctaid``). ``ret`` becomes a branch to the
  logical block's end. Between two logical blocks of a chunk there is a barrier only if
  the kernel has barriers or uses shared memory (reuse hazards); the barrier of the next
  dispatch closes a chunk's last logical block.
* Chunks are all-or-nothing: ids are claimed only after a clear flag check and a block
  runs every id it claimed before it looks at the flag again. So every id below the
  counter (and below ``stop``) is finished when the kernel exits, and *resume* relaunches
  with the same record and goes on. A yield waits for at most one chunk per persistent
  block.
* A launch may also stop at ``stop`` (an extra parameter): ids >= stop are not run, so
  the host can cut a launch into slices (time quanta, deterministic preemption in tests).
* Abort mode adds flag checks at loop back-edges (per thread in loops without
  barriers, block-uniform through shared memory in loops with them); an aborting
  thread marks the record and exits. The launch is then undone by the launcher
  (restart if idempotent, snapshot rollback otherwise).
* Saved aborts (abort mode, where :func:`plan_save` allows: no shared or local memory,
  no barriers, no warp collectives, no calls): a stopping thread instead stores the
  registers live at its check (register liveness, ``liveness.py``), its logical block,
  and its chunk's bounds in its cells of a save area (an extra parameter; cells are
  8-byte columns, one row per resident thread), then *parks*: it waits at the next
  chunk dispatch like its block's other threads, and a block with a parked thread
  claims no more chunks (its claim waits behind a barrier, so no thread misses its part
  of a claimed chunk). A thread parks only when its back edge is about to be taken, and
  saves what is live at that loop's header; the next slice's prologue reloads its
  registers and branches to the header (the loop's one entry, so it stays reducible). Nothing is undone: every (logical block,
  thread) pair runs exactly once, so the abort keeps all progress for any kernel.
* Fencing (Guardian-style): every global load/store/atomic address whose buffer the
  analysis knows is checked against that buffer's base/size (extra parameters); an
  address outside is redirected to a scratch area in the progress record and counted.

Progress record (``PROGRESS_RECORD_BYTES`` bytes of device memory per launch)::

    +0  u32 next logical block (atomic counter)     +4  u32 finished logical blocks
    +8  u64 first yield seen (%globaltimer, min)    +16 u64 last yield exit (max)
    +24 u64 fenced (neutralised) accesses           +32 u32 aborted mid-block (0/1)
    +36 u32 persistent blocks that left on a yield  +40 u64 first block start (min)
    +48 u64 last block exit (max)                   +56 u32 lowest block aborted in (min)
    +64 64-byte fence scratch area

The passes live in modules of their own: the machinery and the record layout in
``rewrite.py``, the body's rewrites in ``block_rewrites.py``, abort mode in
``back_edges.py`` and ``saved_state.py``, the persistent loop in ``persistent.py``;
this module puts them in a pipeline and assembles the result.

What it must not do: launch anything or touch CUDA (``launch.py`` does), or change
``.version``/``.target`` (the transformed text keeps the input's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpushare_ext.kernels.analysis import analyse_entry
from gpushare_ext.kernels.back_edges import BackEdgeChecks, UnrollTightLoops
from gpushare_ext.kernels.block_rewrites import (
    CheckSupported,
    FenceGlobalAccesses,
    RewriteBlockIds,
    RewriteReturns,
)
from gpushare_ext.kernels.persistent import PersistentBlocks
from gpushare_ext.kernels.ptx import KernelError, Param, PtxModule
from gpushare_ext.kernels.report import KernelReport
from gpushare_ext.kernels.rewrite import (
    SAVE_HEADER_CELLS,
    Item,
    Pass,
    Pipeline,
    TransformOptions,
    TransformState,
)

__all__ = [
    "Pass",
    "Pipeline",
    "PreemptibleKernel",
    "TransformOptions",
    "assemble",
    "find_ptxas",
    "make_preemptible",
    "pipeline_for",
]


@dataclass(frozen=True)
class PreemptibleKernel:
    """A transformed kernel: its PTX and the extra parameters the launch must append."""

    name: str
    ptx: str
    options: TransformOptions
    original_params: tuple[Param, ...]
    extra_params: tuple[Param, ...]
    fenced_params: tuple[str, ...]  # for each: base then size in extra_params
    steps: tuple[str, ...]  # names of the passes that ran
    chunk_sync: bool = True  # a barrier between the logical blocks of a chunk
    #: an aborting thread saves its state (else an abort is undone by restart or
    #: rollback); ``saved_registers``: the registers it saves, in cell order
    saves_state: bool = False
    saved_registers: tuple[str, ...] = ()
    save_refusal: str = ""  # why an abort variant does not save state

    @property
    def save_cells(self) -> int:
        """8-byte cells per thread in the save area: tag, block id, chunk end, chunk
        base, then one per saved register."""
        return SAVE_HEADER_CELLS + len(self.saved_registers) if self.saves_state else 0


def _base_passes(options: TransformOptions) -> tuple[Pass, ...]:
    passes: list[Pass] = [CheckSupported(), RewriteBlockIds()]
    if options.fence:
        passes.append(FenceGlobalAccesses())
    if options.abort_checks:
        passes += [UnrollTightLoops(), BackEdgeChecks()]
    passes += [RewriteReturns(), PersistentBlocks()]
    return tuple(passes)


def pipeline_for(options: TransformOptions) -> Pipeline:
    return Pipeline(f"preemptible[{options.key}]", _base_passes(options))


def make_preemptible(
    module: PtxModule,
    name: str,
    options: TransformOptions | None = None,
    *,
    report: KernelReport | None = None,
) -> PreemptibleKernel:
    """Rewrite kernel ``name`` of ``module``; returns the whole module's new PTX text."""
    options = options or TransformOptions()
    entry = module.entry(name)
    if report is None:
        report = analyse_entry(module, entry)
    index = 0
    body: list[Item] = []
    for s in entry.body:
        if s.kind == "instr":
            body.append(Item(s, index))
            index += 1
        else:
            body.append(Item(s))
    state = TransformState(module, entry, report, options, body)
    pipe = pipeline_for(options)
    steps = pipe.run(state)
    ptx = module.render({name: state.text})
    return PreemptibleKernel(
        name=name,
        ptx=ptx,
        options=options,
        original_params=tuple(entry.params),
        extra_params=tuple(state.extra_params),
        fenced_params=tuple(state.fenced),
        steps=tuple(steps),
        chunk_sync=state.chunk_sync,
        saves_state=state.save is not None,
        saved_registers=state.save.registers if state.save is not None else (),
        save_refusal=state.save_refusal,
    )


# ---------------------------------------------------------------------------------------
# Assembling with ptxas (the last step; CPU only)
# ---------------------------------------------------------------------------------------


def find_ptxas() -> str:
    """ptxas from the ``nvidia-cuda-nvcc`` wheel, else ``$PTXAS``, else on PATH."""
    env = os.environ.get("GPUSHARE_PTXAS")
    if env:
        return env
    for root in sys.path:
        for rel in ("nvidia/cu13/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas", "nvidia/cu12/bin/ptxas"):
            cand = Path(root) / rel
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    found = shutil.which("ptxas")
    if found:
        return found
    raise KernelError(
        "no-ptxas",
        "ptxas not found: install the nvidia-cuda-nvcc wheel (pip install nvidia-cuda-nvcc) "
        "or set GPUSHARE_PTXAS",
        step="assemble",
    )


def assemble(ptx: str, arch: str = "sm_90", *, ptxas: str | None = None) -> bytes:
    """Assemble with ptxas; returns the cubin. Raises KernelError with ptxas's log."""
    exe = ptxas or find_ptxas()
    with tempfile.TemporaryDirectory(prefix="gpushare-ptxas-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        out = Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        proc = subprocess.run(
            [exe, f"-arch={arch}", "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise KernelError(
                "ptxas-failed",
                f"ptxas rejected the PTX for {arch}",
                step="assemble",
                log=_annotate_ptxas_log(proc.stderr + proc.stdout, ptx),
            )
        return out.read_bytes()


def _annotate_ptxas_log(log: str, ptx: str) -> str:
    lines = ptx.splitlines()
    out = [log.rstrip()]
    for m in re.finditer(r"line (\d+)", log):
        n = int(m.group(1))
        if 0 < n <= len(lines):
            out.append(f"  {n}: {lines[n - 1].strip()}")
    return "\n".join(out)
