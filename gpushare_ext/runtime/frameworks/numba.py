"""Numba under gpushare: its device, an external memory manager under the lease's
quota, and its kernels' PTX handed to the preemptible-kernel registry.

Numba's allocations go through :func:`numba_memory_manager`'s class, a Numba external
memory manager (EMM) that counts them in the quota ledger.  Numba links its kernels to
a cubin itself, so the launch shim never sees their PTX: a hook on Numba's code library
hands each kernel's PTX and handle over as Numba loads it, with the text of the PTX
files it links the kernel with (``@cuda.jit(link=[...])``: the bodies of the device
functions the kernel declares with ``cuda.declare_device``).

It must not import Numba until Numba is imported by the notebook (or a hook is called).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
import weakref
from typing import Any

from gpushare_ext.runtime import memory
from gpushare_ext.runtime.frameworks.framework import AdopterOf, Framework

NUMBA_MANAGER_ENV = "NUMBA_CUDA_MEMORY_MANAGER"
CODEGEN = "numba.cuda.codegen"


def select_device(ordinal: int, bring_up: bool) -> None:
    if "numba.cuda" in sys.modules:
        from numba import cuda

        cuda.select_device(ordinal)


# ---- the memory quota


def numba_memory_manager() -> type:
    """The Numba EMM class enforcing the ledger; import only where numba-cuda is installed."""
    from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager

    class QuotaMemoryManager(NumbaCUDAMemoryManager):
        """Numba's default memory manager with every allocation checked against the lease."""

        def memalloc(self, size):
            memory.LEDGER.take(size, memory.pooled_bytes(), "Numba")
            try:
                allocation = super().memalloc(size)
            except BaseException:
                memory.LEDGER.give_back(size)
                raise
            weakref.finalize(allocation, memory.LEDGER.give_back, size)
            return allocation

    return QuotaMemoryManager


def install_quota() -> bool:
    """Make Numba allocate through the quota-checking memory manager.

    Numba reads ``NUMBA_CUDA_MEMORY_MANAGER`` (a module with ``_numba_memory_manager``)
    when it is imported, so the variable covers a later ``import numba``; if Numba is
    already imported, the manager is set directly.  Either must happen before Numba
    creates its CUDA context; False when that moment has passed.
    """
    os.environ.setdefault(NUMBA_MANAGER_ENV, __name__)
    if "numba.cuda" not in sys.modules:
        return True
    from numba import cuda

    try:
        cuda.set_memory_manager(numba_memory_manager())
    except Exception:  # a context exists already: Numba refuses a new manager
        return False
    return True


def __getattr__(name: str) -> Any:
    # Numba imports this module by the name in NUMBA_CUDA_MEMORY_MANAGER and asks for
    # ``_numba_memory_manager``; build the class only then (it needs numba-cuda).
    if name == "_numba_memory_manager":
        return numba_memory_manager()
    raise AttributeError(name)


# ---- its kernels, handed over as it loads them


def linked_ptx(library: Any) -> tuple[str, ...]:
    """The PTX texts among the files Numba links ``library``'s kernel with (its
    ``_linking_files``: paths ending in ``.ptx`` and in-memory ``PTXSource`` objects),
    in a stable order.  Others (CUDA C++, cubins, objects, LTO-IR) are not PTX the
    analysis can read: a call into them stays unresolved and the kernel says so."""
    texts: list[str] = []
    for item in list(getattr(library, "_linking_files", ()) or ()):
        with contextlib.suppress(Exception):  # an unreadable file: its calls stay unresolved
            if isinstance(item, (str, os.PathLike)):
                if os.fspath(item).endswith(".ptx"):
                    with open(item, encoding="ascii", errors="replace") as f:
                        texts.append(f.read())
            elif type(item).__name__ == "PTXSource":
                data = item.data
                texts.append(data.decode("ascii", "replace") if isinstance(data, bytes) else data)
    return tuple(sorted(texts))


def _hook_code_library(codegen: Any, adopter_of: AdopterOf) -> None:
    """Have Numba's code library hand each kernel's PTX, handle and linked PTX to the
    adopter when it loads the kernel (``CUDACodeLibrary.get_cufunc``, once per kernel
    and device)."""
    library_class = getattr(codegen, "CUDACodeLibrary", None)
    original = getattr(library_class, "get_cufunc", None)
    if original is None or getattr(original, "_gpushare", False):
        return

    def get_cufunc(self: Any) -> Any:
        cached = bool(getattr(self, "_cufunc_cache", None))
        cufunc = original(self)
        adopter = adopter_of()
        if adopter is not None and not cached:
            # If Numba's internals moved, its kernels just run as they are.
            with contextlib.suppress(Exception):
                adopter.adopt(
                    int(cufunc.handle), self.get_asm_str(), str(self._entry_name),
                    linked=linked_ptx(self),
                )  # fmt: skip
        return cufunc

    get_cufunc._gpushare = True  # type: ignore[attr-defined]
    library_class.get_cufunc = get_cufunc


class _CodegenWatcher(importlib.abc.MetaPathFinder):
    """Hooks Numba's code library once ``numba.cuda.codegen`` is imported (not before: a
    notebook that never uses Numba never imports it)."""

    def __init__(self, adopter_of: AdopterOf) -> None:
        self._adopter_of = adopter_of

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != CODEGEN:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            _hook_code_library(module, self._adopter_of)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def adopt_kernels(adopter_of: AdopterOf) -> None:
    codegen = sys.modules.get(CODEGEN)
    if codegen is not None:
        _hook_code_library(codegen, adopter_of)
    elif not any(isinstance(f, _CodegenWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _CodegenWatcher(adopter_of))


FRAMEWORK = Framework(
    name="numba",
    select_device=select_device,
    install_quota=install_quota,
    adopt_kernels=adopt_kernels,
)
