"""gpushare: interactive shared-GPU sessions for Jupyter.

Entry points for IPython (``%load_ext gpushare_ext``), jupyter_server and JupyterLab
live here.  The user API is re-exported lazily (PEP 562) so that ``import
gpushare_ext`` stays cheap inside every notebook kernel:

* ``gpushare_ext.lease(priority=..., memory_bytes=...)`` -- a scoped lease outside magics;
* ``gpushare_ext.launch(train, ranks=4, ...)`` -- a function trained across 4 slices, one
  worker process per rank with ``torch.distributed`` set up, under one gang lease;
  inside it, ``gpushare_ext.distributed_model(model)`` is DDP with the fastest gradient
  path the slices allow;
* ``gpushare_ext.safe_point()`` -- where a long loop may be held for a higher-priority session;
* ``gpushare_ext.stream()`` -- the session's CUDA stream (CuPy), gated by the broker;
* ``gpushare_ext.device()`` -- the CUDA device of the current lease (for PyTorch);
* ``gpushare_ext.widget()`` -- the live occupancy widget;
* ``gpushare_ext.kernel(src, name)`` / ``@gpushare_ext.jit`` -- preemptible kernels.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "safe_point": ("gpushare_ext.runtime.session", "safe_point"),
    "current_session": ("gpushare_ext.runtime.session", "current_session"),
    "widget": ("gpushare_ext.widgets", "widget"),
    "kernel": ("gpushare_ext.kernels", "kernel"),
    "jit": ("gpushare_ext.kernels", "jit"),
    "distributed_model": ("gpushare_ext.runtime.rank_comm", "distributed_model"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'gpushare_ext' has no attribute {name!r}")


def lease(**options: Any):
    """``with gpushare_ext.lease(priority="high", memory_bytes=8 << 30): ...``"""
    from gpushare_ext.runtime.session import current_session

    return current_session().lease(**options)


def launch(
    target: Any,
    *args: Any,
    ranks: int,
    priority: str | int | None = None,
    memory_bytes: int | None = None,
    sm_share: float | None = None,
    device: str | None = None,
    timeout_s: float | None = None,
    port: int | None = None,
    backend: str | None = None,
    **kwargs: Any,
) -> list:
    """Run ``target(*args, **kwargs)`` in ``ranks`` worker processes, each on its own
    slice of one gang lease (``memory_bytes`` and ``sm_share`` per rank), with
    ``torch.distributed`` initialised among them; return each rank's result.

    The gang is granted whole or waits whole; a higher-priority cell pauses all its
    ranks together.  Every rank's output shows in the cell prefixed ``[rank N]``;
    interrupting the kernel stops all of them, and an exception in one rank ends the
    others and is raised here.  ``backend`` defaults to NCCL when every rank has a
    whole GPU of its own and to gloo otherwise; ``port`` is the rendezvous port on this
    host (a free one by default)."""
    from gpushare_ext.runtime.session import CellOutput, current_session

    options = {
        "priority": priority,
        "memory_bytes": memory_bytes,
        "sm_share": sm_share,
        "device": device,
        "timeout_s": timeout_s,
    }
    return current_session().run_gang(
        target, *args, ranks=ranks, output=CellOutput(), port=port, backend=backend,
        lease_options=options, label=getattr(target, "__name__", "")[:120], **kwargs,
    )  # fmt: skip


def device() -> int | None:
    """CUDA ordinal of the GPU this kernel's current lease is on (``torch.device("cuda", n)``)."""
    from gpushare_ext.runtime import binding

    return binding.current_ordinal


def stream():
    """The session's gated CUDA stream (a CuPy stream), or None without a GPU."""
    from gpushare_ext.runtime.session import current_session

    gate = current_session().device_gate
    return gate.stream if gate is not None else None


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """jupyter_server finds the server extension (the JupyterLab panel's routes) here."""
    return [{"module": "gpushare_ext.server_ext"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """JupyterLab finds the prebuilt panel here (for installs without the data files)."""
    return [{"src": "labextension", "dest": "gpushare-ext"}]


def load_ipython_extension(ipython: Any) -> None:
    from gpushare_ext.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from gpushare_ext.magics import unload

    unload(ipython)
