"""The broker's edges: what the server runs between the socket and the scheduler.

What it is for: the server's lifecycle and connection loop (``server.py``, the only
caller of the core), what the edges share (``context.py``: the state they read, an
outbox, an event queue), messages turned into core events (``requests.py``), the core's
actions carried out (``effects.py``), every journal write for them (``records.py``),
what a viewer sees (``views.py``, ``history_view.py``), the journal read back at start
(``recovery.py``), chaos mode started and stopped (``chaos_mode.py``), Prometheus
metrics (``metrics.py``), the socket's and control blocks' places in the file system
(``places.py``), and a broker started as a child process (``launch.py``).

What it must not be: imported by another wing.  The edges are the broker's top: they
may use the hands, the scheduler and the settings; nothing of the broker uses them.
"""
