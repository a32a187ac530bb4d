"""The gpushare jupyter_server extension: REST and a live stream for the JupyterLab panel.

Loaded by jupyter_server through ``gpushare_ext._jupyter_server_extension_points`` (enabled
by ``jupyter-config/server-config/gpushare_ext.json``).  It adds the routes of
:mod:`gpushare_ext.server_ext.handlers`, and it puts the launch shim
(:mod:`gpushare_ext.runtime.interpose`) in ``LD_PRELOAD`` of the environment the server
starts kernels with, so that a paused session's launches are held whatever framework
makes them (inert in a kernel that never opens a gpushare session).  No background
tasks, no state.

Which broker: ``c.GpushareServerExtension.socket_path`` if set, else
``gpushare_ext.paths.default_socket_path()`` ($GPUSHARE_SOCKET, the system broker's
socket if present, else this user's embedded broker's), looked up per request so a
broker started after the server is found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traitlets import Bool, Unicode
from traitlets.config import LoggingConfigurable

from gpushare_ext.paths import default_socket_path


class GpushareServerExtension(LoggingConfigurable):
    """Settings of the server extension (``c.GpushareServerExtension.<name>`` in config)."""

    socket_path = Unicode(
        "",
        config=True,
        help="Broker socket to use; empty: $GPUSHARE_SOCKET, the system broker, "
        "or this user's embedded broker.",
    )
    preload_launch_shim = Bool(
        True,
        config=True,
        help="Start kernels with the gpushare launch shim in LD_PRELOAD, so that a paused "
        "session's launches are held for every framework (GPUSHARE_INTERPOSER=off also "
        "turns it off).",
    )
    parkable_memory = Bool(
        False,
        config=True,
        help="Start kernels with parkable memory (GPUSHARE_PARKABLE_MEMORY=1): the launch "
        "shim backs large allocations so that it can park them itself, at the host link's "
        "speed and at the same addresses, when the broker parks or evicts the session.",
    )

    def resolve_socket(self) -> Path:
        return Path(self.socket_path) if self.socket_path else default_socket_path()


def preload_for_kernels(environ: dict[str, str], parkable_memory: bool = False) -> str:
    """Put the launch shim first in ``LD_PRELOAD`` of ``environ`` (with
    ``parkable_memory``, have it back large allocations so that it can park them); say
    what was done."""
    from gpushare_ext.runtime.interpose import shim_path

    if environ.get("GPUSHARE_INTERPOSER", "").strip().lower() == "off":
        return "the launch shim is off (GPUSHARE_INTERPOSER=off)"
    shim = shim_path()
    if not shim.exists():
        return f"the launch shim was not built ({shim.name} is missing); kernels run without it"
    present = [
        entry for entry in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if entry
    ]
    if str(shim) not in present:
        environ["LD_PRELOAD"] = ":".join([str(shim), *present])
    # Frameworks then load their kernels as PTX (CuPy: CUPY_COMPILE_WITH_PTX=1), which the
    # shim hands to gpushare's analysis and transform, so long ones can be stopped
    # mid-kernel (runtime/preemptible.py).
    from gpushare_ext.runtime import frameworks

    frameworks.kernel_environment(environ)
    if parkable_memory:
        from gpushare_ext.runtime.parkable import ENABLE_VARIABLE

        environ[ENABLE_VARIABLE] = "1"
        return f"kernels start with the launch shim {shim} and parkable memory"
    return f"kernels start with the launch shim {shim}"


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the gpushare routes on ``server_app``'s web application."""
    import os

    from gpushare_ext.server_ext.handlers import handlers

    settings = GpushareServerExtension(parent=server_app)
    if settings.preload_launch_shim:
        # Kernels inherit the server's environment: set it before any kernel starts.
        said = preload_for_kernels(os.environ, settings.parkable_memory)
        server_app.log.info("gpushare: %s", said)
    web_app = server_app.web_app
    web_app.settings["gpushare_socket_path"] = settings.resolve_socket
    web_app.add_handlers(".*$", handlers(web_app.settings["base_url"]))
    server_app.log.info(
        "gpushare: server extension loaded; broker socket %s", settings.resolve_socket()
    )


# jupyter_server < 2 looked for this name.
load_jupyter_server_extension = _load_jupyter_server_extension
