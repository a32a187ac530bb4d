"""The scheduler: what the broker decides, and nothing else.

What it is for: the core (``core.py``: events in, actions out, time passed in, one
handler table) and the parts it owns, each with one job: admission, the waiting line
(``scheduling_pass.py``), placement and the usable slots, grants and pauses
(``lease_moves.py``), what a waiter is told, gangs, idle sessions parked, the lease book
and its index, and the one function that changes a lease's state
(``lease_transitions.py``); the events, actions and records they speak in; and MIG
planning (``mig.py``), pure in the same way.

What it must not import: the hands (``broker/hands/``) or the edges
(``broker/edges/``); nor asyncio, sockets, SQLite, CUDA or NVML; nor read a clock.  It
imports the ground floor, the broker's error base and the settings (``broker/settings/``)
alone, so the same events always give the same actions.
"""
