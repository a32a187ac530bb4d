"""The last hour of each GPU's leases: who held it when, and when they were paused, at which rung.

What it is for: the timeline the panel and the widget draw (the last :data:`WINDOW_S`
seconds) and the dashboard's (the last :data:`KEEP_S`), which answer "why was my cell
slow?": a lease is a span from its grant to its end, with the pauses inside it (their
start, end and the highest ladder level applied).  The effects feed it as they carry
out grants, preemptions, resumes and ends; the status view reads it per device.  With a
:class:`SpanStore` it writes the changes there when asked (:meth:`Timeline.flush`) and
starts from what the store kept, so a restarted broker still shows the last hour.

What it must not do: decide anything, read a clock (times are passed in), or grow: it
keeps :data:`KEEP_S` seconds and at most :data:`KEEP_SPANS` spans per device, and the
panel gets at most :data:`MAX_SPANS` of the last :data:`WINDOW_S` seconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from gpushare_ext.broker.scheduler.core import Identity

__all__ = [
    "KEEP_S",
    "KEEP_SPANS",
    "MAX_SPANS",
    "WINDOW_S",
    "Pause",
    "Span",
    "SpanStore",
    "Timeline",
]

WINDOW_S = 600.0  # what the panel shows: the last ten minutes
MAX_SPANS = 64  # per device in the panel: a busy host's bars would be too thin beyond that
KEEP_S = 3600.0  # what the dashboard shows: the last hour
KEEP_SPANS = 512  # per device over that hour: the dashboard's reply stays far below a frame


@dataclass
class Pause:
    start: float
    level: int  # the highest ladder level applied during the pause
    end: float | None = None  # None: still paused


@dataclass
class Span:
    lease_id: str
    identity: Identity
    priority: int
    device_index: int
    start: float
    end: float | None = None  # None: still held
    pauses: list[Pause] = field(default_factory=list)
    label: str = ""  # as its owner wrote it; views make it plain text and hide it from others


class SpanStore(Protocol):
    """Where spans outlive the broker (:class:`gpushare_ext.broker.hands.history.HistoryStore`)."""

    def spans_changed(self, spans: list[Span]) -> None: ...

    def load_spans(self, since: float) -> list[Span]: ...


class Timeline:
    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_spans: int = MAX_SPANS,
        *,
        keep_s: float = KEEP_S,
        keep_spans: int = KEEP_SPANS,
        store: SpanStore | None = None,
        now: float = 0.0,
    ) -> None:
        self.window_s = window_s
        self.keep_s = max(keep_s, window_s)
        self._spans: dict[int, deque[Span]] = {}
        self._open: dict[str, Span] = {}
        self._max = max_spans
        self.keep_spans = max(keep_spans, max_spans)
        self._store = store
        self._dirty: dict[int, Span] = {}  # changed and not yet in the store
        if store is not None:
            self._restore(store.load_spans(now - self.keep_s))

    def _restore(self, spans: list[Span]) -> None:
        """Spans a previous broker kept.  An open one goes on if its lease was restored
        (a reclaim's ``granted`` is the same span) and ends with it; the broker's tick
        ends those whose lease did not come back (:meth:`open_lease_ids`)."""
        for span in sorted(spans, key=lambda s: s.start):
            self._add(span)

    def _add(self, span: Span) -> None:
        spans = self._spans.setdefault(span.device_index, deque(maxlen=self.keep_spans))
        if len(spans) == spans.maxlen and spans[0].end is None:
            self._open.pop(spans[0].lease_id, None)
        spans.append(span)
        if span.end is None:
            self._open[span.lease_id] = span

    def _changed(self, span: Span) -> None:
        if self._store is not None:
            self._dirty[id(span)] = span

    def flush(self) -> None:
        """Write the spans changed since the last flush to the store, in one go (the
        broker's tick does it: a busy host grants and ends hundreds of leases a second)."""
        if self._store is not None and self._dirty:
            changed, self._dirty = list(self._dirty.values()), {}
            self._store.spans_changed(changed)

    def granted(
        self, lease_id: str, identity: Identity, priority: int, device_index: int, now: float
    ) -> None:
        if lease_id in self._open:
            return  # a grant seen twice (a reclaim after a restart): one span
        span = Span(lease_id, identity, priority, device_index, now)
        self._add(span)
        self._changed(span)

    def labelled(self, lease_id: str, label: str) -> None:
        """The label of a span still open (the grant does not carry it)."""
        span = self._open.get(lease_id)
        if span is not None and span.label != label:
            span.label = label
            self._changed(span)

    def paused(self, lease_id: str, level: int, now: float) -> None:
        """A pause starts, or one under way goes a rung higher."""
        span = self._open.get(lease_id)
        if span is None:
            return
        if span.pauses and span.pauses[-1].end is None:
            span.pauses[-1].level = max(span.pauses[-1].level, level)
        else:
            span.pauses.append(Pause(now, level))
        self._changed(span)

    def resumed(self, lease_id: str, now: float) -> None:
        span = self._open.get(lease_id)
        if span is not None and span.pauses and span.pauses[-1].end is None:
            span.pauses[-1].end = now
            self._changed(span)

    def ended(self, lease_id: str, now: float) -> None:
        span = self._open.pop(lease_id, None)
        if span is None:
            return
        span.end = now
        if span.pauses and span.pauses[-1].end is None:
            span.pauses[-1].end = now
        self._changed(span)

    def open_lease_ids(self) -> list[str]:
        return list(self._open)

    def _kept(self, device_index: int, now: float) -> deque[Span]:
        spans = self._spans.get(device_index)
        if not spans:
            return deque()
        since = now - self.keep_s
        while spans and spans[0].end is not None and spans[0].end < since:
            spans.popleft()
        return spans

    def spans(self, device_index: int, now: float) -> list[Span]:
        """The last spans of one device that reach into the last ``window_s`` seconds."""
        since = now - self.window_s
        recent = [s for s in self._kept(device_index, now) if s.end is None or s.end >= since]
        return recent[-self._max :]

    def spans_kept(self, device_index: int, now: float) -> list[Span]:
        """Every span of one device that reaches into the last ``keep_s`` seconds."""
        return list(self._kept(device_index, now))
