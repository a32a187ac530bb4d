"""What a GPU framework brings to gpushare: the shape every module of this package fills.

A :class:`Framework` names the hooks gpushare's generic code calls for it: select the
lease's device, check its allocations against the lease's quota, hand over its kernels'
PTX to the preemptible-kernel registry, and the environment a kernel it runs in starts
with.  A framework leaves out what it has no use for.

It must not import any framework (each module imports its own, lazily) nor any other
part of gpushare.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class KernelAdopter(Protocol):
    """Where a framework hands a kernel it loaded itself (the preemptible registry)."""

    def adopt(self, function: int, ptx: str, name: str, linked: Sequence[str] = ()) -> None:
        """Track ``function`` (a CUDA function handle) from its ``ptx``, entry ``name``;
        ``linked``: the PTX texts the framework links it with (their device functions)."""


AdopterOf = Callable[[], KernelAdopter | None]  # the registry in force, asked at each load


def _leave_the_device(ordinal: int, bring_up: bool) -> None:
    return None


@dataclass(frozen=True)
class Framework:
    """One framework's hooks; generic code calls them for every registered framework."""

    name: str
    # Make CUDA device ``ordinal`` current for the cell's thread; ``bring_up``: import
    # the framework first if the session's gate needs it (a whole GPU was selected).
    select_device: Callable[[int, bool], None] = _leave_the_device
    # Route the framework's allocations through the quota ledger; False: it could not.
    install_quota: Callable[[], bool] | None = None
    # Have the framework hand each kernel it loads from its own PTX to the adopter.
    adopt_kernels: Callable[[AdopterOf], None] | None = None
    # Variables a kernel process starts with (where unset), so that the launch shim
    # sees the framework's kernels as PTX.
    kernel_environment: Mapping[str, str] = field(default_factory=dict)
