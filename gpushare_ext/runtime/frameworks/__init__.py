"""One seam per GPU framework: what gpushare does specially for CuPy, Numba and PyTorch.

Each framework is one module here declaring its :class:`Framework` (its device
selection, memory quota, kernel adoption and kernel environment); :data:`FRAMEWORKS`
lists them.  The generic code (device binding, the session's holds, the preemptible
kernels' registry, the server extension) calls the functions below, which ask every
registered framework in turn, and never names a framework itself.  Adding a framework
is one module here and one line in :data:`FRAMEWORKS`.

It must not import a framework at import time (a notebook that never uses Numba never
imports it), nor the generic code that calls it.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from gpushare_ext.runtime.frameworks import cupy, numba, torch
from gpushare_ext.runtime.frameworks.framework import AdopterOf, Framework, KernelAdopter

FRAMEWORKS: list[Framework] = [
    cupy.FRAMEWORK,
    numba.FRAMEWORK,
    torch.FRAMEWORK,
]

__all__ = [
    "FRAMEWORKS",
    "Framework",
    "KernelAdopter",
    "adopt_kernels",
    "install_quotas",
    "kernel_environment",
    "register",
    "select_device",
    "unregister",
]


def register(framework: Framework) -> None:
    """Add ``framework`` (or replace the one of its name) after those registered."""
    unregister(framework.name)
    FRAMEWORKS.append(framework)


def unregister(name: str) -> None:
    FRAMEWORKS[:] = [f for f in FRAMEWORKS if f.name != name]


def select_device(ordinal: int, bring_up: bool = False) -> None:
    """Make CUDA device ``ordinal`` current in every framework this process uses."""
    for framework in list(FRAMEWORKS):
        framework.select_device(ordinal, bring_up)


def install_quotas() -> dict[str, bool]:
    """Check every framework's allocations against the lease: which could be hooked."""
    return {
        framework.name: framework.install_quota()
        for framework in list(FRAMEWORKS)
        if framework.install_quota is not None
    }


def adopt_kernels(adopter_of: AdopterOf) -> None:
    """Have the frameworks that load kernels from their own PTX hand them over."""
    for framework in list(FRAMEWORKS):
        if framework.adopt_kernels is not None:
            framework.adopt_kernels(adopter_of)


def kernel_environment(environ: MutableMapping[str, str]) -> None:
    """Set (where unset) what each framework needs in a kernel's environment."""
    for framework in list(FRAMEWORKS):
        for key, value in framework.kernel_environment.items():
            environ.setdefault(key, value)
