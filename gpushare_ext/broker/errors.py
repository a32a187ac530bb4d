"""The broker layer's error base.

What it is for: every error the daemon raises on purpose (scheduler, policy, inventory,
actuators, journal, places, the MIG command, starting a broker) is a ``DaemonError``, so
one ``except`` catches what the broker explains and lets programming errors through.

What it must not do: import anything of the broker (every broker module imports this).
"""

from __future__ import annotations

from gpushare_ext.errors import GpushareError

__all__ = ["DaemonError"]


class DaemonError(GpushareError):
    """Something the broker refused or could not do, said in one line."""

    code = "broker"
