"""gpushare: interactive shared-GPU sessions for Jupyter.

Entry points for IPython (``%load_ext gpushare_ext``), jupyter_server and JupyterLab
live here; everything else is imported lazily so that ``import gpushare_ext`` stays
cheap inside every notebook kernel.
"""

from __future__ import annotations

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from gpushare_ext.magics import load

    load(ipython)


def unload_ipython_extension(ipython):
    from gpushare_ext.magics import unload

    unload(ipython)
