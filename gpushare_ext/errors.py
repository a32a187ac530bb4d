"""The one base of every error gpushare raises on purpose.

What it is for: ``GpushareError`` carries a stable ``code`` (for programs: tests, the
CLI's exit paths, the panel) and a one-line ``message`` (for people).  Each layer has
its own base below it (``kernels.KernelError``, ``broker.errors.DaemonError``,
``runtime.errors.SessionError``); errors of the ground floor subclass it directly.
Built-in bases stay where callers rely on them (a quota overrun is still a
``MemoryError``, a timeout a ``TimeoutError``).

What it must not do: import anything of gpushare (it is the ground floor) or format
anything beyond the one line.
"""

from __future__ import annotations

__all__ = ["GpushareError"]


class GpushareError(Exception):
    """A refusal or failure gpushare explains: ``code`` and a one-line ``message``."""

    code: str = "error"

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        if "message" not in self.__dict__:  # a subclass may have set its own first
            self.message = str(args[0]) if args else ""

    def in_cell(self) -> str:
        """How a notebook cell shows it (one line)."""
        return str(self)
