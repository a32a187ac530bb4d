"""The broker's configuration: the ``[broker]`` table of the TOML file plus the policy.

The same file holds the scheduling policy (see :mod:`gpushare_ext.broker.settings.policy`);
this module reads the operational keys (socket, journal, inventory, limits, metrics)
through :mod:`gpushare_ext.broker.settings.schema`, which says what each key accepts, and tells
which changed keys a running broker cannot apply without a restart.  Every error is a
one-line :class:`PolicyError`; the file itself is read only if no other user can have
written it.  This module must not act on a setting (open the socket,
read the token file): the server does that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from gpushare_ext.broker.settings import schema
from gpushare_ext.broker.settings.config_text import parse_document
from gpushare_ext.broker.settings.policy import Policy, PolicyError, policy_from_document
from gpushare_ext.safe_fs import UnsafePathError, read_trusted_file


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


#: The largest config file the broker reads: a policy for thousands of users fits many
#: times over; a path to something endless (``/dev/zero``) is refused, not read.
CONFIG_MAX_BYTES = 1 << 20


def parse_config(text: str | bytes, source: str = "config") -> BrokerConfig:
    """The config in ``text``; PolicyError, one line naming the key, for anything wrong."""
    document = parse_document(text, source)
    broker_table = schema.sections(document, source).broker
    broker = schema.read_broker(broker_table, source)
    policy = policy_from_document(document, source)
    own = {key: value for key, value in broker.items() if key in _OWN_KEYS}
    return BrokerConfig(policy=policy, given=frozenset(broker_table), **own)  # type: ignore[arg-type]


def load_config(path: str | Path | None) -> BrokerConfig:
    """The config in the file at ``path`` (the built-in defaults for None).

    The broker takes orders from this file (who is admin, what each user may use), so
    it is read only if nobody but root and the broker's own user can have written it
    (:func:`~gpushare_ext.safe_fs.read_trusted_file`): the file, the directories on its
    way and any link to it; a regular file of at most :data:`CONFIG_MAX_BYTES`.
    """
    if path is None:
        return BrokerConfig()
    try:
        data = read_trusted_file(
            path, trusted={os.geteuid()}, max_bytes=CONFIG_MAX_BYTES, what="config"
        )
    except UnsafePathError as exc:
        raise PolicyError(str(exc)) from None
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
