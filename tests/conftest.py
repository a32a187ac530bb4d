"""Shared fixtures: a real broker subprocess on the simulated H200, and real Unix users.

The helpers live in ``support.py`` (a module name no other folder uses), so test files
import them from there; importing from ``conftest`` would pick whichever conftest came
first.
"""

import atexit
import os
import shutil
import tempfile

from support import *  # noqa: F403 - the fixtures must be names of this module

# No test meets the host's own gpushare: where clients look for a system broker is a
# path of this run's own, which nothing serves (a test that wants a system broker starts
# one and names its socket).  Kernels and children the tests start inherit it.
_NO_SYSTEM_BROKER = tempfile.mkdtemp(prefix="gps-no-system-")
os.chmod(_NO_SYSTEM_BROKER, 0o755)  # every test user looks there and finds nothing
os.environ["GPUSHARE_SYSTEM_SOCKET"] = os.path.join(_NO_SYSTEM_BROKER, "broker.sock")
atexit.register(shutil.rmtree, _NO_SYSTEM_BROKER, True)
