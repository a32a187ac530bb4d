"""Notebook widgets of gpushare: the live occupancy view (``%gpu status``, ``gpushare_ext.widget()``)."""

from __future__ import annotations

from pathlib import Path

from gpushare_ext.widgets.occupancy import OccupancyWidget

__all__ = ["OccupancyWidget", "widget"]


def widget(socket_path: str | Path | None = None) -> OccupancyWidget:
    """A live view of this host's GPUs, their MIG layout, the queue and your sessions.

    It follows the broker at ``socket_path`` (default: the one ``gpushare`` would use)
    about once a second without blocking the kernel; ``.close()`` stops it.
    """
    return OccupancyWidget(socket_path)
