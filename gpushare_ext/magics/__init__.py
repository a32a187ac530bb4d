"""IPython magics: ``%%gpu`` (run a cell under a lease), ``%gpu`` and ``%gpuconfig``.

Loaded by ``%load_ext gpushare_ext`` or ``c.InteractiveShellApp.extensions``, which also
puts the parked-session restore at the top of every cell (:mod:`runtime.parking`) and
has IPython report a ``%%gpu`` cell's syntax error before the cell runs; unloading
releases every lease the kernel holds and closes the broker connection.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def load(ipython: Any) -> None:
    from gpushare_ext.magics.gpu import GpuMagics, syntax_errors_as_the_cells
    from gpushare_ext.runtime import cell_lines, interpose, parking, preemptible

    ipython.register_magics(GpuMagics)
    # A %%gpu cell's syntax error is shown before the cell runs, as any cell's is.
    if syntax_errors_as_the_cells not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(syntax_errors_as_the_cells)
    # Every cell, marked or not, first restores a parked session (and says it runs).
    parking.install(ipython)
    # Kernels CuPy compiles from now on are seen as they load, before any %%gpu cell.
    try:
        preemptible.install()
    except interpose.InterposerError as exc:
        print(cell_lines.notice(str(exc)), file=sys.stderr)
    # A cell that ran launches the shim can only hold and lock says so, once per kind.
    with contextlib.suppress(ValueError):
        ipython.events.unregister("post_run_cell", preemptible.after_cell)
    ipython.events.register("post_run_cell", preemptible.after_cell)


def unload(ipython: Any) -> None:
    from gpushare_ext.magics.gpu import syntax_errors_as_the_cells
    from gpushare_ext.runtime import parking, preemptible
    from gpushare_ext.runtime.session import reset_session

    parking.uninstall(ipython)
    with contextlib.suppress(ValueError):
        ipython.input_transformers_cleanup.remove(syntax_errors_as_the_cells)
    with contextlib.suppress(ValueError):
        ipython.events.unregister("post_run_cell", preemptible.after_cell)
    reset_session()
    magics = ipython.magics_manager.magics
    for kind in ("line", "cell"):
        for name in ("gpu", "gpuconfig"):
            magics[kind].pop(name, None)
