"""The broker's configuration: the ``[broker]`` table of the TOML file plus the policy.

The same file holds the scheduling policy (see :mod:`gpushare_ext.broker.policy`);
this module reads the operational keys (socket, journal, inventory, limits, metrics)
and validates them, naming any unknown or wrong key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpushare_ext.broker.policy import Policy, PolicyError, policy_from_document

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_BROKER_KEYS = {
    "socket": str,
    "journal": str,
    "inventory": str,
    "metrics_port": int,
    "max_connections_per_uid": int,
    "max_requests_per_second": (int, float),
    "reclaim_grace_s": (int, float),
    "lock_timeout_ms": int,
    "socket_group": str,
    "admin_groups": list,
    "admin_users": list,
    "sharing": str,
    "evict_when_memory_needed": bool,
    "mps": bool,
    "node_name": str,
    "devices": list,
}


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    socket: str | None = None
    journal: str | None = None
    inventory: str = "auto"
    metrics_port: int | None = None
    max_connections_per_uid: int = 32
    max_requests_per_second: float = 200.0
    reclaim_grace_s: float = 30.0
    lock_timeout_ms: int = 5000
    socket_group: str | None = None
    node_name: str | None = None
    devices: list[int] | None = None  # GPU indices this broker manages (None: all)
    policy: Policy = field(default_factory=Policy)


def parse_config(text: str, source: str = "config") -> BrokerConfig:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source} is not valid TOML: {exc}") from None
    broker = document.get("broker", {})
    for key, value in broker.items():
        expected = _BROKER_KEYS.get(key)
        if expected is None:
            raise PolicyError(
                f"{source}: unknown setting broker.{key}; known: {', '.join(sorted(_BROKER_KEYS))}"
            )
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise PolicyError(f"{source}: broker.{key} has the wrong type ({type(value).__name__})")
    devices = broker.get("devices")
    if devices is not None and not all(isinstance(i, int) and i >= 0 for i in devices):
        raise PolicyError(f"{source}: broker.devices must list GPU indices, e.g. [0, 1]")
    policy = policy_from_document(document)
    values = {k: v for k, v in broker.items() if k in BrokerConfig.__dataclass_fields__}
    return BrokerConfig(policy=policy, **values)


def load_config(path: str | Path | None) -> BrokerConfig:
    if path is None:
        return BrokerConfig()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"cannot read {path}: {exc.strerror}") from None
    return parse_config(text, str(path))
