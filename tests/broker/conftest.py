"""The broker's tests, laid out by the broker's wings: ``settings/``, ``scheduler/``,
``hands/`` and ``edges/``, each holding the tests of the code in that wing.

The helpers they share stay here, one folder up from their users: ``broker_wire.py``
(frames by hand, leases held from other processes), ``lease_holder.py`` (the process
that holds one) and ``scheduler_helpers.py`` (the core with a clock and named
sessions). This folder goes on ``sys.path`` so that every test imports them as plain
modules (``from broker_wire import ...``), whichever wing it stands in.
"""

import sys
from pathlib import Path

_HELPERS = str(Path(__file__).resolve().parent)
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
