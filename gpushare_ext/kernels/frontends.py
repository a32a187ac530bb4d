"""Where kernels come from: CUDA C++ (NVRTC), PTX text and Numba ``@cuda.jit`` functions.

What it is for: the notebook-facing objects. ``kernel(src, name)`` compiles CUDA C++ the
way CuPy ``RawKernel`` users write it (or takes PTX as is); ``@jit`` wraps a Python
function Numba can compile. Both give a :class:`Kernel` that is analysed (``.report``),
can be transformed (``.preemptible()``) and is launched like CuPy/Numba kernels::

    k = kernel(src, "saxpy")
    k[grid, block](a, x, y, n)         # or k(grid, block, (a, x, y, n))

CUDA C++ is compiled by :mod:`~gpushare_ext.kernels.toolchain` (NVRTC for a source
string, nvcc for a file); Numba's own compiler turns a Python function into PTX here.
Compiling needs only the toolchain wheels (NVRTC, NVVM), never a GPU; launching imports
CuPy and the driver lazily (``launch.py``).

What it must not do: call nvcc or NVRTC itself (the toolchain does), talk to CUDA
devices, or decide the transactional policy (``launch.py`` owns both).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from gpushare_ext.kernels.analysis import analyse_entry
from gpushare_ext.kernels.ptx import KernelError, PtxModule, parse_ptx
from gpushare_ext.kernels.report import KernelReport
from gpushare_ext.kernels.signatures import kernel_definitions, name_entries, strip_comments
from gpushare_ext.kernels.sourcefile import find_entry
from gpushare_ext.kernels.toolchain import DEFAULT_ARCH, CompileOptions, compile_cuda, compile_file
from gpushare_ext.kernels.transform import (
    PreemptibleKernel,
    TransformOptions,
    make_preemptible,
)

__all__ = [
    "ArgBinding",
    "Kernel",
    "NumbaKernel",
    "compile_numba",
    "is_ptx",
    "jit",
    "kernel",
]


def is_ptx(text: str) -> bool:
    return bool(re.search(r"^\s*\.version\s+\d", text, re.M)) and ".target" in text


@dataclass(frozen=True)
class ArgBinding:
    """How one user argument maps onto PTX parameters.

    ``kind``: ``plain`` (one parameter: a pointer or a scalar) or ``numba-array``
    (Numba's flattened array: meminfo, parent, nitems, itemsize, data, shape..., strides...).
    """

    name: str
    kind: str
    params: tuple[str, ...]
    ndim: int = 0

    @property
    def data_param(self) -> str:
        return self.params[4] if self.kind == "numba-array" else self.params[0]


class Kernel:
    """A kernel a notebook user can analyse and launch preemptibly.

    ``k.report`` is the analysis (classification with reasons), ``k.ptx`` the PTX,
    ``k.preemptible(abort_checks=..., fence=...)`` the transformed kernel.
    """

    def __init__(
        self,
        ptx: str,
        name: str,
        *,
        source_names: dict[str, str] | None = None,
        bindings: Sequence[ArgBinding] | None = None,
        pointer_params: Sequence[str] | None = None,
        origin: str = "ptx",
        compile_source: Callable[[str], str] | None = None,
    ) -> None:
        self.ptx = ptx
        self.module: PtxModule = parse_ptx(ptx)
        self.entry = self.module.entry(name)
        self.name = name
        self.origin = origin
        if source_names:
            self.entry.source_names.update(source_names)
        self.bindings: tuple[ArgBinding, ...] = (
            tuple(bindings)
            if bindings
            else tuple(
                ArgBinding(self.entry.display_name(p.name), "plain", (p.name,))
                for p in self.entry.params
            )
        )
        self._pointer_params = pointer_params
        self._variants: dict[TransformOptions, PreemptibleKernel] = {}
        self._compile_source = compile_source
        self.last_launch: Any = None
        self._launcher: Any = None

    def __repr__(self) -> str:
        return f"<gpushare kernel {self.entry.name} ({self.report.classification.verdict.value})>"

    @cached_property
    def report(self) -> KernelReport:
        return analyse_entry(self.module, self.entry, pointer_params=self._pointer_params)

    @property
    def classification(self):
        return self.report.classification

    def preemptible(self, *, abort_checks: bool = False, fence: bool = False) -> PreemptibleKernel:
        opts = TransformOptions(abort_checks=abort_checks, fence=fence)
        if opts not in self._variants:
            self._variants[opts] = make_preemptible(
                self.module, self.entry.name, opts, report=self.report
            )
        return self._variants[opts]

    # -- launching (CuPy / Numba style) -------------------------------------------------

    def __getitem__(self, config: Any) -> Callable[..., Any]:
        if not isinstance(config, tuple) or len(config) < 2:
            raise KernelError(
                "bad-launch-config", "use k[grid, block](*args) or k[grid, block, stream, shared]"
            )
        grid, block, *rest = config
        stream = rest[0] if len(rest) > 0 else None
        shared = rest[1] if len(rest) > 1 else 0

        def launch(*args: Any, **kw: Any) -> Any:
            kw.setdefault("stream", stream)
            kw.setdefault("shared_mem", shared)
            return self.launch(grid, block, args, **kw)

        return launch

    def __call__(self, grid: Any, block: Any, args: Sequence[Any], **kw: Any) -> Any:
        return self.launch(grid, block, args, **kw)

    def launch(self, grid: Any, block: Any, args: Sequence[Any], **kw: Any) -> Any:
        """Launch as a transaction (see ``launch.py``); keywords: stream, shared_mem, mode,
        fence, sm_share, max_blocks, yield_flag, preempt_at, abort_at, preemptible."""
        from gpushare_ext.kernels.launch import launch_kernel

        return launch_kernel(self, grid, block, tuple(args), **kw)

    def bind(self, args: Sequence[Any]) -> Kernel:
        """The concrete kernel for these arguments (Numba specialises; others are fixed)."""
        return self


def kernel(
    src: str | os.PathLike[str],
    name: str,
    *,
    arch: str = DEFAULT_ARCH,
    options: Sequence[str] = (),
    name_expressions: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    defines: Sequence[str] = (),
    std: str | None = None,
) -> Kernel:
    """A preemptible kernel from CUDA C++ source (NVRTC), PTX text, or a ``.cu`` file.

    ``name`` is the kernel's name as written (``saxpy`` or ``tmm<float>``); mangled C++
    names are resolved through NVRTC name expressions.  Given a path, the file is
    compiled as nvcc builds it (host code, system headers, ``include_dirs``,
    ``defines``, ``std``) and ``name`` may also be a qualified name (``ns::step``).
    """
    if isinstance(src, os.PathLike):
        return _kernel_from_file(Path(src), name, arch, include_dirs, defines, std)
    if is_ptx(src):
        return Kernel(src, name, origin="ptx")
    exprs = list(dict.fromkeys([name, *name_expressions]))
    try:
        ptx, lowered = compile_cuda(src, arch=arch, names=exprs, options=options)
    except KernelError as exc:
        if exc.code != "compile-failed":
            raise
        # The name may not be a valid name expression (e.g. an extern "C" entry written
        # differently): compile without it; a real compile error raises again here.
        ptx, lowered = compile_cuda(src, arch=arch, options=options)
    k = Kernel(ptx, lowered.get(name, name), origin="cuda")
    name_entries(k.module, kernel_definitions(strip_comments(src)))
    _bind_source_names(k)
    return k


def _kernel_from_file(
    path: Path,
    name: str,
    arch: str,
    include_dirs: Sequence[str | os.PathLike[str]],
    defines: Sequence[str],
    std: str | None,
) -> Kernel:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise KernelError(
            "unreadable", f"{path}: cannot read it ({exc.strerror or exc})", step="compile"
        ) from None
    options = CompileOptions(
        include_dirs=tuple(Path(d) for d in include_dirs),
        defines=tuple(defines),
        std=std,
        arch=arch,
    )
    compiled = compile_file(path, text, options)
    module = parse_ptx(compiled.ptx)
    entry = find_entry(module, name)
    k = Kernel(compiled.ptx, entry.name, origin="cuda-file")
    name_entries(k.module, kernel_definitions(compiled.preprocessed or strip_comments(text)))
    _bind_source_names(k)
    return k


def _bind_source_names(k: Kernel) -> None:
    """Arguments named as in the source, where every parameter's name is known."""
    names = [k.entry.source_names.get(p.name) for p in k.entry.params]
    if names and all(names):
        k.bindings = tuple(
            ArgBinding(str(n), "plain", (p.name,))
            for p, n in zip(k.entry.params, names, strict=True)
        )


# ---------------------------------------------------------------------------------------
# Numba
# ---------------------------------------------------------------------------------------


def _numba_param_layout(
    sig_args: Sequence[Any], arg_names: Sequence[str]
) -> list[tuple[str, str, int]]:
    """(argument name, kind, ndim) per argument; arrays expand to 5 + 2*ndim params."""
    from numba.core import types

    out = []
    for name, ty in zip(arg_names, sig_args, strict=True):
        if isinstance(ty, types.Array):
            out.append((name, "numba-array", ty.ndim))
        elif isinstance(ty, (types.Number, types.Boolean)):
            out.append((name, "plain", 0))
        else:
            raise KernelError(
                "unsupported-argument", f"argument {name!r} of Numba type {ty} is not supported"
            )
    return out


def compile_numba(
    pyfunc: Callable[..., Any], signature: Any, *, arch: str = DEFAULT_ARCH
) -> Kernel:
    """Compile a Python function with Numba's ``compile_ptx`` (no GPU needed)."""
    import inspect

    try:
        from numba import cuda
    except ImportError as exc:  # pragma: no cover
        raise KernelError("no-numba", "numba-cuda is not installed", step="compile") from exc
    cc = tuple(int(c) for c in arch.replace("sm_", "").replace("compute_", ""))
    cc = (cc[0], cc[1]) if len(cc) == 2 else (int(arch[-2]), int(arch[-1]))
    try:
        ptx, _ = cuda.compile_ptx(pyfunc, signature, cc=cc, lineinfo=True)
    except Exception as exc:
        raise KernelError(
            "compile-failed",
            f"Numba could not compile {pyfunc.__name__}: {type(exc).__name__}",
            step="compile",
            log=str(exc),
        ) from exc
    module = parse_ptx(ptx)
    if len(module.entries) != 1:
        raise KernelError("bad-ptx", "Numba produced no single kernel entry", step="compile")
    entry = module.entries[0]
    from numba.core.sigutils import normalize_signature

    args, _ = normalize_signature(signature)
    arg_names = list(inspect.signature(pyfunc).parameters)
    layout = _numba_param_layout(args, arg_names)
    params = [p.name for p in entry.params]
    bindings: list[ArgBinding] = []
    names: dict[str, str] = {}
    pos = 0
    for name, kind, ndim in layout:
        if kind == "numba-array":
            n = 5 + 2 * ndim
            ps = tuple(params[pos : pos + n])
            labels = ["meminfo", "parent", "nitems", "itemsize", "data"]
            labels += [f"shape[{i}]" for i in range(ndim)] + [f"strides[{i}]" for i in range(ndim)]
            for p, lab in zip(ps, labels, strict=True):
                names[p] = name if lab == "data" else f"{name}.{lab}"
            bindings.append(ArgBinding(name, kind, ps, ndim))
            pos += n
        else:
            names[params[pos]] = name
            bindings.append(ArgBinding(name, kind, (params[pos],)))
            pos += 1
    if pos != len(params):
        raise KernelError(
            "numba-abi",
            f"Numba kernel {pyfunc.__name__} has {len(params)} PTX parameters, expected {pos}",
            step="compile",
        )
    data_params = [b.data_param for b in bindings if b.kind == "numba-array"]
    return Kernel(
        ptx,
        entry.name,
        source_names=names,
        bindings=bindings,
        pointer_params=data_params,
        origin="numba",
    )


def _numba_type_of(value: Any) -> Any:
    import numpy as np
    from numba import from_dtype, types

    if hasattr(value, "__cuda_array_interface__") or (
        hasattr(value, "dtype") and hasattr(value, "ndim") and value.ndim > 0
    ):
        layout = "C" if getattr(getattr(value, "flags", None), "c_contiguous", False) else "A"
        return types.Array(from_dtype(np.dtype(value.dtype)), value.ndim, layout)
    if isinstance(value, bool):
        return types.boolean
    if isinstance(value, int):
        return types.int64
    if isinstance(value, float):
        return types.float64
    if isinstance(value, np.generic):
        return from_dtype(value.dtype)
    raise KernelError(
        "unsupported-argument", f"cannot pass {type(value).__name__} to a Numba kernel"
    )


class NumbaKernel:
    """``@jit`` result: compiles per argument types (or eagerly with a signature)."""

    def __init__(self, pyfunc: Callable[..., Any], signature: Any = None, arch: str = DEFAULT_ARCH):
        self.pyfunc = pyfunc
        self.arch = arch
        self._by_types: dict[Any, Kernel] = {}
        self.__name__ = getattr(pyfunc, "__name__", "kernel")
        self.__doc__ = pyfunc.__doc__
        self._eager: Kernel | None = None
        if signature is not None:
            self._eager = compile_numba(pyfunc, signature, arch=arch)

    def __repr__(self) -> str:
        return f"<gpushare jit kernel {self.__name__}>"

    @property
    def kernel(self) -> Kernel:
        if self._eager is None:
            raise KernelError(
                "not-compiled", f"{self.__name__} compiles at its first launch; pass a signature"
            )
        return self._eager

    @property
    def report(self) -> KernelReport:
        return self.kernel.report

    def bind(self, args: Sequence[Any]) -> Kernel:
        from numba.core import types

        key = tuple(_numba_type_of(a) for a in args)
        if key not in self._by_types:
            self._by_types[key] = compile_numba(self.pyfunc, types.void(*key), arch=self.arch)
        return self._by_types[key]

    def __getitem__(self, config: Any) -> Callable[..., Any]:
        grid, block, *rest = config

        def launch(*args: Any, **kw: Any) -> Any:
            if rest:
                kw.setdefault("stream", rest[0])
            if len(rest) > 1:
                kw.setdefault("shared_mem", rest[1])
            return self.launch(grid, block, args, **kw)

        return launch

    def __call__(self, grid: Any, block: Any, args: Sequence[Any], **kw: Any) -> Any:
        return self.launch(grid, block, args, **kw)

    def launch(self, grid: Any, block: Any, args: Sequence[Any], **kw: Any) -> Any:
        k = self.bind(args)
        result = k.launch(grid, block, args, **kw)
        self.last_launch = k.last_launch
        return result

    last_launch: Any = None


def jit(fn: Callable[..., Any] | None = None, *, signature: Any = None, arch: str = DEFAULT_ARCH):
    """Decorator: ``@jit`` or ``@jit(signature="void(float32[:], float32[:])")``."""
    if fn is None:
        return lambda f: NumbaKernel(f, signature, arch)
    return NumbaKernel(fn, signature, arch)
