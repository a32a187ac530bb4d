"""The broker's hands: what touches the machine, and what the broker keeps on it.

What it is for: the GPUs as NVML (or a simulated twin) describes them
(``inventory.py``), the preemption ladder's actuators (``actuators.py``), the SQLite
journal and its WAL checkpoints (``journal.py``, ``checkpointer.py``), the last hour of
each GPU kept across a restart (``history.py``, ``timeline.py``), the peers at the other
end of the socket (``peers.py``: identity from ``SO_PEERCRED``, rate limits), and chaos
mode's schedule and the runner that applies it through the ladder (``chaos.py``,
``chaos_runner.py``).

What it must not import: the edges (``broker/edges/``).  A hand does what it is asked
and answers; it never handles a request or calls the core.  It may read the
scheduler's records and the settings.
"""
