"""The gpushare jupyter_server extension: REST and a live stream for the JupyterLab panel.

Loaded by jupyter_server through ``gpushare_ext._jupyter_server_extension_points`` (enabled
by ``jupyter-config/server-config/gpushare_ext.json``).  It adds the routes of
:mod:`gpushare_ext.server_ext.handlers` and nothing else: no background tasks, no state.

Which broker: ``c.GpushareServerExtension.socket_path`` if set, else
``gpushare_ext.paths.default_socket_path()`` ($GPUSHARE_SOCKET, the system broker's
socket if present, else this user's embedded broker's), looked up per request so a
broker started after the server is found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traitlets import Unicode
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

    def resolve_socket(self) -> Path:
        return Path(self.socket_path) if self.socket_path else default_socket_path()


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the gpushare routes on ``server_app``'s web application."""
    from gpushare_ext.server_ext.handlers import handlers

    settings = GpushareServerExtension(parent=server_app)
    web_app = server_app.web_app
    web_app.settings["gpushare_socket_path"] = settings.resolve_socket
    web_app.add_handlers(".*$", handlers(web_app.settings["base_url"]))
    server_app.log.info(
        "gpushare: server extension loaded; broker socket %s", settings.resolve_socket()
    )


# jupyter_server < 2 looked for this name.
load_jupyter_server_extension = _load_jupyter_server_extension
