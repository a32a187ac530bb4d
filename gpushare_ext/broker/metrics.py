"""Prometheus metrics of one broker, served on an opt-in loopback port.

The server calls the ``observe_*`` methods as things happen and ``refresh`` with each
snapshot; nothing here decides anything.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from gpushare_ext.protocol import LeaseState, Snapshot, priority_class


class BrokerMetrics:
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
        self._server = None

    def serve(self, port: int, address: str = "127.0.0.1") -> None:
        self._server = start_http_server(port, addr=address, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            thread.join(timeout=2)
            self._server = None

    def observe_grant(self, priority: int, waited_s: float) -> None:
        self.wait_seconds.labels(priority_class(priority)).observe(waited_s)

    def observe_preemption(self, level: int, failed: bool = False) -> None:
        (self.preemption_failures if failed else self.preemptions).labels(str(level)).inc()

    def refresh(self, snapshot: Snapshot) -> None:
        counts = {state.value: 0 for state in LeaseState}
        for lease in snapshot.leases:
            counts[lease.state.value] += 1
        for state, count in counts.items():
            self.leases.labels(state).set(count)
        for name in ("low", "normal", "high"):
            self.queue_length.labels(name).set(snapshot.queue_by_priority.get(name, 0))
        for device in snapshot.devices:
            label = str(device.info.index)
            self.device_memory_used.labels(label).set(device.memory_used_mib * 1024 * 1024)
            self.device_memory_leased.labels(label).set(device.memory_leased_mib * 1024 * 1024)
            self.device_memory_total.labels(label).set(device.info.memory_total_mib * 1024 * 1024)
