"""PyTorch under gpushare: the lease's device, once PyTorch has started CUDA.

PyTorch allocates past any hook of ours (its caching allocator), so its memory is held
to the lease by the broker's NVML watchdog, and its kernels run as they are under the
launch shim.  PyTorch code should use ``gpushare_ext.device()`` for new tensors.

It must not import PyTorch: only a process that already did is told the device.
"""

from __future__ import annotations

import sys

from gpushare_ext.runtime.frameworks.framework import Framework


def select_device(ordinal: int, bring_up: bool) -> None:
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.set_device(ordinal)


FRAMEWORK = Framework(name="torch", select_device=select_device)
