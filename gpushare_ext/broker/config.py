"""The broker's configuration: the ``[broker]`` table of the TOML file plus the policy.

The same file holds the scheduling policy (see :mod:`gpushare_ext.broker.policy`);
this module reads the operational keys (socket, journal, inventory, limits, metrics)
through :mod:`gpushare_ext.broker.schema`, which says what each key accepts, and tells
which changed keys a running broker cannot apply without a restart.  Every error is a
one-line :class:`PolicyError`.  This module must not act on a setting (open the socket,
read the token file): the server does that.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from gpushare_ext.broker import schema
from gpushare_ext.broker.policy import Policy, PolicyError, policy_from_document

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """The ``[broker]`` settings (defaults as in ``schema.BROKER_SETTINGS``) and the policy."""

    socket: str | None = None
    journal: str | None = None
    inventory: str = "auto"
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    metrics_token_file: str | None = None
    max_connections_per_uid: int = 32
    max_requests_per_second: float = 200.0
    reclaim_grace_s: float = 30.0
    lock_timeout_ms: int = 5000
    grant_after_stops_ms: int = 30
    journal_keep_hours: float = 24.0
    socket_group: str | None = None
    node_name: str | None = None
    devices: list[int] | None = None  # GPU indices this broker manages (None: all)
    policy: Policy = field(default_factory=Policy)
    given: frozenset[str] = frozenset()  # the [broker] keys the file named


_OWN_KEYS = frozenset(f.name for f in fields(BrokerConfig)) - {"policy", "given"}


def _text_of(data: str | bytes, source: str) -> str:
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(
                f"{source} is not a text file (byte {exc.start} is not UTF-8)"
            ) from None
    # tomllib would name the NUL as an invalid character; a file with one is not a
    # config file that got a typo but something else put in its place.
    if "\0" in data:
        raise PolicyError(f"{source} is not a text file (it holds NUL bytes)")
    return data


def parse_config(text: str | bytes, source: str = "config") -> BrokerConfig:
    """The config in ``text``; PolicyError, one line naming the key, for anything wrong."""
    try:
        document = tomllib.loads(_text_of(text, source))
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source} is not valid TOML: {' '.join(str(exc).split())}") from None
    broker_table = schema.sections(document, source).broker
    broker = schema.read_broker(broker_table, source)
    policy = policy_from_document(document, source)
    own = {key: value for key, value in broker.items() if key in _OWN_KEYS}
    return BrokerConfig(policy=policy, given=frozenset(broker_table), **own)  # type: ignore[arg-type]


def load_config(path: str | Path | None) -> BrokerConfig:
    """The config in the file at ``path`` (the built-in defaults for None)."""
    if path is None:
        return BrokerConfig()
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse_config(data, str(path))


def restart_needed(running: BrokerConfig, new: BrokerConfig) -> list[str]:
    """The ``[broker]`` keys ``new`` names with a value a running broker cannot apply.

    Only keys the new file names count: one it leaves out may hold the value the running
    broker got from its command line, which a reload does not change either.
    """
    return [
        key
        for key in schema.restart_keys()
        if key in new.given and getattr(new, key) != getattr(running, key)
    ]
