"""What the broker's edges share: the state they read, and the two ways out of them.

:mod:`~gpushare_ext.broker.edges.requests`, :mod:`~gpushare_ext.broker.edges.effects`,
:mod:`~gpushare_ext.broker.edges.views`, :mod:`~gpushare_ext.broker.edges.recovery` and chaos mode
take a :class:`BrokerContext` (in the spirit of uvicorn's ``ServerState``), never the
server's ``Broker``.  They read the scheduler (through
:class:`~gpushare_ext.broker.scheduler.core.CoreView`: no way to change it), the inventory, the readings, the
timeline; they write the journal through its one :class:`~gpushare_ext.broker.edges.records.Recorder`.
Whatever they want done beyond that leaves through one of two queues:

* the :class:`Outbox`: messages for a connection; the server writes them to sockets;
* the :class:`EventQueue`: core events; the server alone feeds them to the core
  (``Scheduler.handle``) and carries out the actions that come back.

The server attaches what empties each queue when it starts.  An event posted while no
other is being fed is fed before ``post`` returns, so an edge may read the core's state
right after posting; one posted while an action is being carried out waits until the
event under way has had all its actions carried out.  Events are fed in the order
posted.

It holds state and queues only: it must not import the server or the edges, decide
anything, or touch sockets and actuators itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare_ext.broker.edges.metrics import BrokerMetrics
from gpushare_ext.broker.edges.records import Recorder
from gpushare_ext.broker.hands.actuators import Ladder, ProcessControl, Target
from gpushare_ext.broker.hands.chaos_runner import ChaosRunner
from gpushare_ext.broker.hands.history import History
from gpushare_ext.broker.hands.inventory import InventoryBackend
from gpushare_ext.broker.hands.journal import Journal
from gpushare_ext.broker.hands.peers import Connection, TokenBucket
from gpushare_ext.broker.hands.timeline import Timeline
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.settings.config import BrokerConfig
from gpushare_ext.devices import DeviceInfo, DeviceReading
from gpushare_ext.paths import BrokerPaths
from gpushare_ext.protocol import BrokerMessage

log = logging.getLogger("gpushare.broker")


@dataclass(frozen=True)
class Reply:
    """Which request the actions of one event answer.

    ``to`` is the request's ``seq``; actions about ``lease_id`` carry it back.  ``conn``
    receives the ``Released`` of a lease ended on its behalf (an admin's cancel, or a
    release from another notebook of the same user), and the answer to a park it asked
    for (``park``).
    """

    to: int = 0
    lease_id: str | None = None
    conn: Connection | None = None
    park: bool = False


NO_REPLY = Reply()


class Outbox:
    """Messages for connections, in the order put; the server writes them to sockets.

    A message can be *reserved* (:meth:`reserve`) and filled in later (:meth:`fill`):
    what is put for that connection meanwhile waits behind it, so a message sent late
    still reaches its connection before the ones put after it was reserved."""

    def __init__(self) -> None:
        self._pending: deque[tuple[Connection, BrokerMessage]] = deque()
        self._write: Callable[[Connection, BrokerMessage], None] | None = None
        # Per connection held back: its messages in order, a reserved place being a list
        # that holds nothing until it is filled.
        self._held: dict[Connection, deque[list[BrokerMessage]]] = {}

    def reserve(self, conn: Connection) -> list[BrokerMessage]:
        """A place for a message to ``conn``, before any put from now on."""
        place: list[BrokerMessage] = []
        self._held.setdefault(conn, deque()).append(place)
        return place

    def fill(self, conn: Connection, place: list[BrokerMessage], message: BrokerMessage) -> None:
        """Put ``message`` in its reserved ``place``; send what no longer waits."""
        place.append(message)
        held = self._held.get(conn)
        while held and held[0]:
            self._pending.append((conn, held.popleft()[0]))
        if held is not None and not held:
            del self._held[conn]
        self.flush()

    def attach(self, write: Callable[[Connection, BrokerMessage], None]) -> None:
        self._write = write
        self.flush()

    def put(self, conn: Connection, message: BrokerMessage) -> None:
        held = self._held.get(conn)
        if held is not None:
            held.append([message])
            return
        self._pending.append((conn, message))
        self.flush()

    def flush(self) -> None:
        write = self._write
        if write is None:
            return  # nobody writes yet: they go once the server attaches
        pending = self._pending
        while pending:
            write(*pending.popleft())


class EventQueue:
    """Core events the edges want fed to the core, fed by the server in the order posted."""

    def __init__(self) -> None:
        self._pending: deque[tuple[core.Event, Reply]] = deque()
        self._feed: Callable[[core.Event, Reply], object] | None = None
        self._feeding = False

    def attach(self, feed: Callable[[core.Event, Reply], object]) -> None:
        self._feed = feed

    def post(self, event: core.Event, reply: Reply = NO_REPLY) -> None:
        """Have ``event`` fed to the core; what the core refuses (``SchedulerError``)
        reaches the poster when it is fed at once."""
        self._pending.append((event, reply))
        if not self._feeding:
            self._drain()

    def _drain(self) -> None:
        feed = self._feed
        if feed is None:
            return
        pending = self._pending
        self._feeding = True
        try:
            while pending:
                event, reply = pending.popleft()
                feed(event, reply)
        finally:
            self._feeding = False


class Tasks:
    """Ladder steps and chaos runners under way, which the shutdown lets finish."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.running.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("an actuator step failed unexpectedly: %r", task.exception())

    async def drain(self, timeout: float) -> None:
        """Let the steps under way finish (shutdown), cancelling the rest after ``timeout``."""
        pending = set(self.running)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=1)


@dataclass(kw_only=True, eq=False)
class BrokerContext:
    """The broker's state as its edges see it; the server owns and updates it."""

    config: BrokerConfig
    config_path: Path | None
    paths: BrokerPaths
    inventory: InventoryBackend
    inventory_note: str | None
    devices: list[DeviceInfo]
    scheduler: core.CoreView  # read only: the server alone feeds the core its events
    control: ProcessControl
    ladder: Ladder
    journal: Journal  # read back at start; every write goes through ``record``
    record: Recorder
    metrics: BrokerMetrics
    pid: int
    node: str
    sessions_dir: Path
    salt: str = ""
    should_exit: bool = False
    timeline: Timeline = field(default_factory=Timeline)  # the last minutes of each GPU
    gpu_history: History = field(default_factory=History)  # the dashboard's last hour
    history: dict[int, deque[int]] = field(default_factory=dict)  # GPU -> utilization
    readings: dict[int, DeviceReading] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # lease id -> actuator note
    yield_flags: dict[str, tuple[str, int]] = field(
        default_factory=dict
    )  # lease -> (handle, offset)
    chaos: dict[int, ChaosRunner] = field(default_factory=dict)  # pid -> its chaos runner
    connections: dict[str, Connection] = field(default_factory=dict)  # session id -> connection
    all_connections: set[Connection] = field(default_factory=set)
    buckets: dict[int, TokenBucket] = field(default_factory=dict)  # uid -> its request rate
    outbox: Outbox = field(default_factory=Outbox)
    events: EventQueue = field(default_factory=EventQueue)
    tasks: Tasks = field(default_factory=Tasks)

    @property
    def simulated_control(self) -> bool:
        return self.control.kind == "simulated"

    def target(
        self, lease_id: str, pid: int, slot: str | None, device_index: int | None = None
    ) -> Target:
        """What the ladder acts on for ``lease_id``: its process, GPU, control block and
        yield flag, as the core and the connections have them now."""
        lease = self.scheduler.lease_of(lease_id)
        session = self.connections.get(lease.session_id) if lease else None
        if device_index is None:
            key = slot or (lease.slot if lease else None)
            device_index = self.scheduler.slots[key].device_index if key else 0
        return Target(
            lease_id=lease_id,
            pid=pid,
            device_index=device_index,
            control_block=session.control_block if session else None,
            yield_flag=self.yield_flags.get(lease_id),
        )
