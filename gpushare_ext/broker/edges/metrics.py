"""Prometheus metrics of one broker, served on an opt-in port (loopback by default).

The server calls the ``observe_*`` methods as things happen and ``refresh`` once a
second with the leases counted; nothing here decides anything.  The HTTP side is
prometheus_client's WSGI app in a threading ``wsgiref`` server on a daemon thread,
behind a bearer-token check when the config names a token file.  This module must not
read the config or reach into the scheduler: the server hands it a port, an address,
a token and the counts.
"""

from __future__ import annotations

import errno
import hmac
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from gpushare_ext.broker.settings.policy import PolicyError
from gpushare_ext.protocol import LeaseState, priority_class
from gpushare_ext.safe_fs import describe_owner

_MAX_TOKEN_BYTES = 4096
_UNAUTHORIZED_BODY = b"401 Unauthorized: send the broker's metrics token as a bearer token\n"

WSGIApp = Callable[[dict, Callable], Iterable[bytes]]


def read_token_file(path: str | Path) -> str:
    """The bearer token in ``path``, stripped; PolicyError (one line naming the path) if the
    file is missing, a symbolic link, owned by anyone but the broker's user or root, open
    to group or others (it is a secret: another user who owns or can read it knows it),
    empty, or not one token."""
    path = Path(path)
    try:
        # O_NOFOLLOW: a link (another user's, to a file of theirs) is refused, not read.
        # fstat on the open file: the owner and mode checked are those of the bytes read.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            data = file.read(_MAX_TOKEN_BYTES + 1) if stat.S_ISREG(info.st_mode) else b""
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PolicyError(
                f"metrics token file {path} is a symbolic link; name the file itself"
            ) from None
        raise PolicyError(f"metrics token file {path}: {exc.strerror or exc}") from None
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        raise PolicyError(f"metrics token file {path} is not a regular file")
    if info.st_uid not in (0, os.geteuid()):
        raise PolicyError(
            f"metrics token file {path} belongs to {describe_owner(info.st_uid)}, who then "
            "knows the token; it must belong to the broker's user or root"
        )
    if mode & 0o077:
        raise PolicyError(
            f"metrics token file {path} is open to group or others (mode "
            f"{stat.S_IMODE(mode):04o}); make it private: chmod 600 {path}"
        )
    if len(data) > _MAX_TOKEN_BYTES:
        raise PolicyError(f"metrics token file {path} is over {_MAX_TOKEN_BYTES} bytes")
    token = data.strip()
    if not token:
        raise PolicyError(f"metrics token file {path} is empty")
    # A header carries the token: it must be one word of printable ASCII.
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise PolicyError(
            f"metrics token file {path} must hold one token of printable ASCII without spaces"
        )
    return token.decode("ascii")


def _bearer_only(app: WSGIApp, token: str) -> WSGIApp:
    expected = token.encode("utf-8")

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        # WSGI hands headers over as latin-1 text: encoding back gives the bytes sent.
        header = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        scheme, _, given = header.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="gpushare metrics"'),
                ("Content-Length", str(len(_UNAUTHORIZED_BODY))),
            ],
        )
        return [_UNAUTHORIZED_BODY]

    return guarded


class _QuietHandler(WSGIRequestHandler):
    # Every scrape would otherwise write a line to the broker's stderr.
    def log_message(self, format: str, *args: object) -> None:
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    # Daemon request threads: a stuck scraper cannot hold up the broker's exit.
    daemon_threads = True


def _server_class(address: str, port: int) -> type[_ThreadingServer]:
    # WSGIServer binds AF_INET unless told otherwise; ask the resolver which family
    # the address is (numeric addresses need no DNS), as http.server does.
    found = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = found[0][0]

    class Server(_ThreadingServer):
        address_family = family

    return Server


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One device's memory gauges."""

    index: int
    used_bytes: int
    leased_bytes: int
    total_bytes: int


class BrokerMetrics:
    """The broker's Prometheus registry, its HTTP endpoint, and what the server observes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leases = Gauge("gpushare_leases", "Leases by state", ["state"], registry=self.registry)
        self.queue_length = Gauge(
            "gpushare_queue_length",
            "Queued requests by priority class",
            ["priority"],
            registry=self.registry,
        )
        self.wait_seconds = Histogram(
            "gpushare_wait_seconds",
            "Time from request to grant",
            ["priority"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 1800, 7200),
            registry=self.registry,
        )
        self.preemptions = Counter(
            "gpushare_preemptions", "Preemptions by ladder level", ["level"], registry=self.registry
        )
        self.preemption_failures = Counter(
            "gpushare_preemption_failures",
            "Preemptions that failed, by level",
            ["level"],
            registry=self.registry,
        )
        self.device_memory_used = Gauge(
            "gpushare_device_memory_used_bytes",
            "Device memory in use",
            ["device"],
            registry=self.registry,
        )
        self.device_memory_leased = Gauge(
            "gpushare_device_memory_leased_bytes",
            "Device memory promised to leases",
            ["device"],
            registry=self.registry,
        )
        self.device_memory_total = Gauge(
            "gpushare_device_memory_total_bytes",
            "Device memory",
            ["device"],
            registry=self.registry,
        )
        self.requests = Counter(
            "gpushare_requests", "Client messages by type", ["type"], registry=self.registry
        )
        self.errors = Counter(
            "gpushare_errors", "Error replies by code", ["code"], registry=self.registry
        )
        self.refusals = Counter(
            "gpushare_refusals",
            "Requests the broker refused (e.g. over a policy quota), by code",
            ["code"],
            registry=self.registry,
        )
        self.priority_lowered = Counter(
            "gpushare_priority_lowered",
            "Requests whose priority the policy lowered to the user's max_priority",
            registry=self.registry,
        )
        self._server: tuple[WSGIServer, threading.Thread] | None = None

    def serve(self, port: int, address: str = "127.0.0.1", token: str | None = None) -> None:
        """Serve the metrics on ``address:port``; with ``token``, only to requests that
        carry ``Authorization: Bearer <token>`` (others get 401).  Replaces an earlier
        server of this object."""
        if token is not None and not token:
            raise ValueError("an empty metrics token would let every request in")
        self.close()
        app: WSGIApp = make_wsgi_app(self.registry)
        if token is not None:
            app = _bearer_only(app, token)
        httpd = make_server(
            address, port, app, _server_class(address, port), handler_class=_QuietHandler
        )
        # A short poll interval: close() waits up to one interval for the loop to notice.
        thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="gpushare-metrics",
            daemon=True,
        )
        thread.start()
        self._server = (httpd, thread)

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()  # frees the port for a restart in the same process
            thread.join(timeout=2)
            self._server = None

    def observe_grant(self, priority: int, waited_s: float) -> None:
        self.wait_seconds.labels(priority_class(priority)).observe(waited_s)

    def observe_preemption(self, level: int, failed: bool = False) -> None:
        (self.preemption_failures if failed else self.preemptions).labels(str(level)).inc()

    def observe_refusal(self, code: str) -> None:
        self.refusals.labels(code).inc()

    def observe_priority_lowered(self) -> None:
        self.priority_lowered.inc()

    def refresh(
        self,
        leases: Mapping[str, int],
        queue_by_priority: Mapping[str, int],
        devices: Iterable[DeviceMemory],
    ) -> None:
        """The gauges: active leases per state, queued ones per priority class, and the
        memory of each device (a state or class not named counts 0)."""
        for state in LeaseState:
            self.leases.labels(state.value).set(leases.get(state.value, 0))
        for name in ("low", "normal", "high"):
            self.queue_length.labels(name).set(queue_by_priority.get(name, 0))
        for device in devices:
            label = str(device.index)
            self.device_memory_used.labels(label).set(device.used_bytes)
            self.device_memory_leased.labels(label).set(device.leased_bytes)
            self.device_memory_total.labels(label).set(device.total_bytes)
