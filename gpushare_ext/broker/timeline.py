"""The last minutes of each GPU: who held it when, and when they were paused, at which rung.

What it is for: the timeline the panel and the widget draw, which answers "why was my
cell slow?": a lease is a span from its grant to its end, with the pauses inside it
(their start, end and the highest ladder level applied).  The effects feed it as they
carry out grants, preemptions, resumes and ends; the status view reads it per device.

What it must not do: decide anything, read a clock (times are passed in), or grow: it
keeps :data:`WINDOW_S` seconds and at most :data:`MAX_SPANS` spans per device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpushare_ext.broker.core import Identity

__all__ = ["MAX_SPANS", "WINDOW_S", "Pause", "Span", "Timeline"]

WINDOW_S = 600.0  # what the panel shows: the last ten minutes
MAX_SPANS = 64  # per device: a busy host's bars would be too thin to read beyond that


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


class Timeline:
    def __init__(self, window_s: float = WINDOW_S, max_spans: int = MAX_SPANS) -> None:
        self.window_s = window_s
        self._spans: dict[int, deque[Span]] = {}
        self._open: dict[str, Span] = {}
        self._max = max_spans

    def granted(
        self, lease_id: str, identity: Identity, priority: int, device_index: int, now: float
    ) -> None:
        if lease_id in self._open:
            return  # a grant seen twice (a reclaim after a restart): one span
        span = Span(lease_id, identity, priority, device_index, now)
        spans = self._spans.setdefault(device_index, deque(maxlen=self._max))
        if len(spans) == spans.maxlen and spans[0].end is None:
            self._open.pop(spans[0].lease_id, None)
        spans.append(span)
        self._open[lease_id] = span

    def paused(self, lease_id: str, level: int, now: float) -> None:
        """A pause starts, or one under way goes a rung higher."""
        span = self._open.get(lease_id)
        if span is None:
            return
        if span.pauses and span.pauses[-1].end is None:
            span.pauses[-1].level = max(span.pauses[-1].level, level)
        else:
            span.pauses.append(Pause(now, level))

    def resumed(self, lease_id: str, now: float) -> None:
        span = self._open.get(lease_id)
        if span is not None and span.pauses and span.pauses[-1].end is None:
            span.pauses[-1].end = now

    def ended(self, lease_id: str, now: float) -> None:
        span = self._open.pop(lease_id, None)
        if span is None:
            return
        span.end = now
        if span.pauses and span.pauses[-1].end is None:
            span.pauses[-1].end = now

    def spans(self, device_index: int, now: float) -> list[Span]:
        """The spans of one device that reach into the last ``window_s`` seconds."""
        spans = self._spans.get(device_index)
        if not spans:
            return []
        since = now - self.window_s
        while spans and spans[0].end is not None and spans[0].end < since:
            spans.popleft()
        return [s for s in spans if s.end is None or s.end >= since]
