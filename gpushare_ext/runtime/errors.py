"""The runtime layer's error base.

What it is for: every error the notebook side raises on purpose (a lease refused or
timed out, a binding, the gate, the launch shim, the embedded broker, a memory quota)
is a ``SessionError``; the ``%%gpu`` magic catches that one type (and the client's
``BrokerError`` from the ground floor, through their common base).

What it must not do: import anything of the runtime (every runtime module imports this).
"""

from __future__ import annotations

from gpushare_ext.errors import GpushareError

__all__ = ["SessionError"]


class SessionError(GpushareError):
    """Something the session refused or could not do, said in one line."""

    code = "session"
