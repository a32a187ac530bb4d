"""Units both sides of the socket speak: sizes in bytes, durations, priority bands.

What it is for: reading and writing sizes the way people write them ("8GiB", "512 MB",
1024) and durations ("30s", "15m", "none"), and telling which class a priority number
falls in.  Broker, runtime, magics and
status views all use these, so they live on the ground floor.

What it must not do: import anything from gpushare_ext (it is below everything) or know
about policy (what sizes are allowed is the broker's business).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "GIB",
    "KIB",
    "MIB",
    "PIB",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
    "priority_band",
]

KIB = 1024
MIB = 1024**2
GIB = 1024**3
PIB = 1024**5
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|m|min|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
NO_DURATION = ("none", "never", "off", "0", "inf", "forever")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
# A bare letter and "Xi"/"XiB" are binary, "XB" is decimal, the way people write them.
_UNITS = {"": 1, "B": 1} | {
    f"{letter}{suffix}": (1000 if suffix == "B" else 1024) ** power
    for power, letter in enumerate("KMGTP", start=1)
    for suffix in ("", "I", "IB", "B")
}


def _as_typed(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error message, cut short if it is long (a message is one
    line, whatever was typed)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` ("8GiB", "512MB", "1.5G", 1024); ValueError with a readable reason.

    Exact for any number of digits (no float in between, which would overflow or round):
    whether a size is too large is for the caller to say, who knows its limit.
    """
    if isinstance(text, bool):
        raise ValueError("a size must be a number of bytes or text like 8GiB")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{_as_typed(str(text))} is not a size (examples: 8GiB, 512MiB, 2GB)")
    number, unit = match.groups()
    multiplier = _UNITS.get((unit or "").upper())
    if multiplier is None:
        raise ValueError(f"{_as_typed(str(text))} has an unknown unit {unit!r}")
    if len(number) > 4000:  # Python refuses to read integers past 4300 digits
        raise ValueError(f"{_as_typed(str(text))} has too many digits for a size")
    return int(Fraction(number) * multiplier)


def format_size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num_bytes} B"  # pragma: no cover


def priority_band(value: float) -> int:
    """The class of a priority number: 0 low, 1 normal, 2 high.  Preemption crosses bands only."""
    return int(min(max(value, 0), 299) // 100)


def parse_duration(text: str) -> float | None:
    """Seconds in ``text`` ("30s", "5m", "1.5h", "250ms", a bare number of seconds); None
    for "none", "never", "off" or "0" (no limit); ValueError with a readable reason."""
    if text.strip().lower() in NO_DURATION:
        return None
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration (examples: 30s, 5m, 1h, none)")
    number, unit = match.groups()
    return float(number) * _DURATION_UNITS[(unit or "s").lower()]


def format_duration(seconds: float) -> str:
    """A duration the way a person says it: "0.4 s", "12 s", "16 min", "2.5 h"."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
