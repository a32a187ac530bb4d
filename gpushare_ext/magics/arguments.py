"""Parsing of ``%%gpu`` / ``%gpuconfig`` arguments: ``key=value`` and ``--key value`` alike.

Pure functions, so every bad input has a test.  Each error is one line naming the bad
argument and what would be accepted.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from gpushare_ext.errors import GpushareError
from gpushare_ext.protocol import MAX_RANKS, Bytes, ShortText, SliceWish, priority_value
from gpushare_ext.units import format_size, parse_duration, parse_size

# The wire's own limits, read from the protocol's types: a value past them is refused
# here, naming the argument, and never reaches the broker as a malformed message.
MAX_MEMORY_BYTES: int = Bytes.__metadata__[0].le
MAX_DEVICE_CHARS: int = ShortText.__metadata__[0].max_length

KEYS = {
    "priority": "low | normal | high | 0-299",
    "mem": "device memory, e.g. 8GiB, 512MiB",
    "device": "auto | a device index | a GPU-… or MIG-… UUID",
    "timeout": "how long to wait for the GPU, e.g. 30s, 5m, none",
    "slice": "auto | mig | shared | exclusive",
    "share": "SM share for transformed kernels, a number in (0, 1]",
    "instrumented": "yes if all GPU work of the cell goes through gpushare kernels",
    "ranks": "run the cell in this many worker processes, one slice each (torch.distributed)",
}
ALIASES = {"memory": "mem", "prio": "priority", "sm_share": "share", "wait": "timeout"}


class ArgumentError(GpushareError, ValueError):
    """One bad argument; the message is what the user reads."""


def tokenize(line: str) -> list[tuple[str, str]]:
    """``priority=high --mem 8GiB`` -> [("priority", "high"), ("mem", "8GiB")]."""
    try:
        # comments=True: "%gpuconfig mem=40GiB  # this notebook's defaults" is a comment,
        # whose apostrophe must not open a quotation.
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        raise ArgumentError(
            f"cannot read {line.strip()!r}: {str(exc).lower()} (a quote or apostrophe "
            "that starts a value must be closed)"
        ) from None
    pairs = []
    index = 0
    while index < len(words):
        word = words[index]
        if word.startswith("--"):
            key = word[2:]
            if "=" in key:
                key, value = key.split("=", 1)
            else:
                if index + 1 >= len(words) or words[index + 1].startswith("--"):
                    raise ArgumentError(
                        f"--{key} needs a value ({KEYS.get(ALIASES.get(key, key), '?')})"
                    )
                value = words[index + 1]
                index += 1
        elif "=" in word:
            key, value = word.split("=", 1)
        else:
            raise ArgumentError(
                f"unexpected argument {word!r}; use key=value or --key value with keys: "
                f"{', '.join(KEYS)}"
            )
        key = ALIASES.get(key.lower(), key.lower())
        if key not in KEYS:
            raise ArgumentError(f"unknown argument {key!r}; known: {', '.join(KEYS)}")
        given = next((v for k, v in pairs if k == key), None)
        if given is not None:
            raise ArgumentError(f"{key} is given twice ({given} and {value}); give it once")
        pairs.append((key, value))
        index += 1
    return pairs


def _memory(value: str) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError("must be more than 0")
    if size > MAX_MEMORY_BYTES:
        raise ValueError(
            f"{_shortened(value)} is more than {format_size(MAX_MEMORY_BYTES)}, the most a "
            "request may ask for"
        )
    return size


def _shortened(value: str, limit: int = 40) -> str:
    """A value as typed, cut short for a one-line message."""
    return value if len(value) <= limit else value[:limit] + "..."


def _device(value: str) -> str:
    text = value.strip()
    if len(text) > MAX_DEVICE_CHARS:
        raise ValueError(f"{_shortened(text)!r} is longer than any device name or UUID")
    if not (
        text == "auto" or (text.isascii() and text.isdecimal()) or text.startswith(("GPU-", "MIG-"))
    ):
        raise ValueError(f"{text!r} is not auto, an index or a GPU-/MIG- UUID")
    return text


def _slice(value: str) -> SliceWish:
    try:
        return SliceWish(value.strip().lower())
    except ValueError:
        raise ValueError(f"{value!r} is not one of auto, mig, shared, exclusive") from None


def _share(value: str) -> float:
    share = float(value)
    if not 0 < share <= 1:
        raise ValueError(f"{value} is outside (0, 1]")
    return share


def _instrumented(value: str) -> bool:
    flag = value.strip().lower()
    if flag not in ("yes", "no", "true", "false", "1", "0"):
        raise ValueError(f"{value!r} is not yes or no")
    return flag in ("yes", "true", "1")


def _ranks(value: str) -> int:
    text = value.strip()
    if not (text.isascii() and text.isdecimal()) or not 1 <= int(text) <= MAX_RANKS:
        raise ValueError(f"{value!r} is not a whole number from 1 to {MAX_RANKS}")
    return int(text)


# Each key: the LeaseOptions field it sets, and how its value is read (a ValueError
# says what is wrong with it).
_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "priority": ("priority", priority_value),
    "mem": ("memory_bytes", _memory),
    "device": ("device", _device),
    "timeout": ("timeout_s", parse_duration),
    "slice": ("slice", _slice),
    "share": ("sm_share", _share),
    "instrumented": ("instrumented_only", _instrumented),
    "ranks": ("ranks", _ranks),
}


def parse_lease_arguments(line: str) -> dict:
    """Keyword overrides for :class:`LeaseOptions` from a magic's argument line."""
    options: dict = {}
    for key, value in tokenize(line):
        if key not in _FIELDS:
            continue
        field, read = _FIELDS[key]
        try:
            options[field] = read(value)
        except ValueError as exc:
            raise ArgumentError(f"bad value for {key}: {exc} (expected {KEYS[key]})") from None
    return options
