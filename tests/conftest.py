"""Shared fixtures: a real broker subprocess on the simulated H200, and real Unix users.

The helpers live in ``support.py`` (a module name no other folder uses), so test files
import them from there; importing from ``conftest`` would pick whichever conftest came
first.
"""

from support import *  # noqa: F403 - the fixtures must be names of this module
