"""Where a cell's gpushare lines go: live lines in the output area of one cell.

It sends what it is given and words nothing itself (the wording is in
:mod:`cell_lines`); it must not talk to the broker or know of leases.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any


class CellOutput:
    """Live lines in the output area of one cell, writable from any thread.

    In a Jupyter kernel it sends display/update messages with the parent header of the
    cell that was running when it was created, so a notice from the broker's listener
    thread lands under the right cell.  Elsewhere (terminal IPython, scripts) it prints.
    """

    def __init__(self) -> None:
        self._kernel: Any = None
        self._parent: Any = None
        self._shell: Any = None
        self._shown: set[str] = set()
        self._lock = threading.Lock()
        try:
            from IPython import get_ipython

            shell = get_ipython()
            self._shell = shell
            kernel = getattr(shell, "kernel", None)
            if kernel is not None and hasattr(kernel, "session"):
                self._kernel = kernel
                getter = getattr(kernel, "get_parent", None)
                self._parent = (
                    getter("shell") if getter else getattr(kernel, "_parent_header", None)
                )
        except ImportError:
            pass

    def show(self, key: str, text: str) -> None:
        """Show ``text`` as the line ``key``: a new line the first time, replaced after."""
        with self._lock:
            first = key not in self._shown
            self._shown.add(key)
        if self._kernel is None:
            print(text, flush=True)
            return
        kernel = self._kernel
        content = {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": key}}
        kind = "display_data" if first else "update_display_data"
        with contextlib.suppress(Exception):
            kernel.session.send(
                kernel.iopub_socket, kind, content, parent=self._parent, ident=kernel._topic(kind)
            )

    def show_last(self, key: str, text: str) -> None:
        """Show ``text`` as the cell's last line: after what the cell printed and after
        its traceback, which IPython shows only once the cell's code has returned.

        In IPython the line waits for the end of the cell (``post_run_cell``, which runs
        once the traceback and the result are out; the hooks registered at load, like
        the launch shim's one-time lines, run before it).  Without IPython there is no
        traceback to wait for: it is shown now.
        """
        shell = self._shell
        events = getattr(shell, "events", None)
        if events is None:
            self.show(key, text)
            return

        def at_the_end(*_result: object) -> None:
            with contextlib.suppress(ValueError):
                events.unregister("post_run_cell", at_the_end)
            # What the cell printed is still buffered by the kernel's streams: out first.
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            self.show(key, text)

        events.register("post_run_cell", at_the_end)
