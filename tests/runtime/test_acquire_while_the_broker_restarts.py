"""Asking for a lease while the broker restarts: the cell waits for it, and says so.

Real brokers on private sockets (``gpushare broker --simulate h200``), real
:class:`GpuSession` objects (the runtime a ``%%gpu`` cell uses), no Jupyter:

* notebooks asking in a loop -- some from a session made a moment ago, as a kernel's
  first cell -- while the broker is ``kill -9``-ed and started again on the same socket
  and journal: every request is granted, none fails at once, and when the traffic
  ends the broker holds no lease (none was granted twice, none lost its owner);
* a session made while the broker is down waits for it and is granted; its live line
  says the broker is restarting and counts the wait, and its last word says the wait
  is over ("reconnected");
* a wait that ends without a broker (the cell's timeout, a Ctrl-C) ends its line with
  "stopped waiting", never with the word that it still waits;
* a broker that answers "shutting down" to a request made nothing of it: the request
  waits for the next broker and is granted there;
* a session with no broker at all (no socket) is told so at once, without a
  "restarting" line.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from support import short_tempdir

from gpushare_ext.client import BrokerClient, BrokerError, BrokerUnavailable
from gpushare_ext.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    FrameReader,
    Hello,
    RequestLease,
    Welcome,
    decode_client_message,
    encode_frame,
)
from gpushare_ext.runtime.session import GpuSession, LeaseOptions, LeaseTimeout

GIB = 1024**3
CLIENTS = 3
KILLS = 4
RESTARTING = "gpushare: the broker is restarting; reconnecting -- "
_FORK = multiprocessing.get_context("fork")


class Lines:
    """A cell's output area: every line shown, in order, by key (what ``CellOutput`` shows)."""

    def __init__(self) -> None:
        self.shown: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def show(self, key: str, text: str) -> None:
        with self._lock:
            self.shown.append((key, text))

    def texts(self) -> list[str]:
        with self._lock:
            return [text for _, text in self.shown]

    def last_of(self, prefix: str) -> str:
        """The last line shown under the key whose first line starts with ``prefix``."""
        with self._lock:
            key = next(k for k, text in self.shown if text.startswith(prefix))
            return [text for k, text in self.shown if k == key][-1]


def _notebook(socket_path: str, index: int, folder: str) -> None:
    """One notebook process: a lease asked, held a moment and released, round after round;
    every other round from a session made just then (a kernel's first cell)."""
    stop, close = Path(folder, "stop"), Path(folder, "close")
    kept = GpuSession(socket_path, notebook=f"loop-{index}.ipynb")
    counts: dict = {"asked": 0, "granted": 0, "failed": [], "waited_visibly": 0}
    while not stop.exists():
        fresh = counts["asked"] % 2 == 1
        session = GpuSession(socket_path) if fresh else kept
        lines = Lines()
        counts["asked"] += 1
        try:
            handle = session.acquire(
                LeaseOptions(memory_bytes=(1 + index) * GIB, timeout_s=30.0), output=lines
            )
        except Exception as exc:  # what a cell would have shown as its error
            counts["failed"].append(f"{'fresh' if fresh else 'kept'}: {type(exc).__name__}: {exc}")
        else:
            counts["granted"] += 1
            time.sleep(0.02)
            with contextlib.suppress(BrokerError):
                session.release(handle)
        finally:
            if fresh:
                session.close()
        counts["waited_visibly"] += any(text.startswith(RESTARTING) for text in lines.texts())
    Path(folder, f"client-{index}.json").write_text(json.dumps(counts))
    deadline = time.monotonic() + 60
    while not close.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the test looks at the broker's leases before this session ends
    kept.close()


def test_acquires_while_the_broker_is_killed_and_restarted_all_wait_and_are_granted(
    start_broker, tmp_path
):
    broker = start_broker(config_toml="[broker]\nmax_requests_per_second = 100000\n")
    clients = [
        _FORK.Process(target=_notebook, args=(str(broker.socket), index, str(tmp_path)))
        for index in range(CLIENTS)
    ]
    for client in clients:
        client.start()
    try:
        for _ in range(KILLS):
            time.sleep(0.4)  # traffic on a live broker ...
            assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
            time.sleep(0.2)  # ... and requests made while none listens
            broker.start()
        time.sleep(0.5)
        (tmp_path / "stop").touch()
        results = []
        for index in range(CLIENTS):
            result = tmp_path / f"client-{index}.json"
            deadline = time.monotonic() + 60
            while not result.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            results.append(json.loads(result.read_text()))
        # Every session released what it was granted: a lease granted by a broker that
        # died before its answer arrived, and asked again, would still be held here.
        with _probe(broker.socket) as probe:
            left = [(lease.lease_id, lease.pid, lease.state) for lease in probe.status().leases]
    finally:
        (tmp_path / "stop").touch()
        (tmp_path / "close").touch()
        for client in clients:
            client.join(timeout=30)
            if client.is_alive():
                client.kill()
    failed = [line for result in results for line in result["failed"]]
    assert failed == [], failed
    assert all(result["granted"] >= 5 for result in results), results
    assert sum(result["waited_visibly"] for result in results) > 0, results  # met the restarts
    assert left == []


def _probe(path: Path) -> BrokerClient:
    """A status client of the test's own (it holds no lease)."""
    return BrokerClient(path, client="cli", connect_timeout=5)


def _in_thread(fn):
    """Run ``fn`` in a thread; return a getter of ``(result, exception)`` once it ended."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # the test looks at whatever ended it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def finished(timeout: float = 30.0):
        thread.join(timeout)
        assert not thread.is_alive(), "the acquire did not end"
        return outcome.get("result"), outcome.get("error")

    return finished


def test_a_session_made_while_the_broker_is_down_waits_for_it_and_says_so(start_broker):
    broker = start_broker()
    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL  # its socket stays, refusing
    session = GpuSession(broker.socket, notebook="first-cell.ipynb")
    lines = Lines()
    try:
        finished = _in_thread(
            lambda: session.acquire(LeaseOptions(memory_bytes=GIB, timeout_s=30), output=lines)
        )
        deadline = time.monotonic() + 10
        while not any(t.startswith(RESTARTING) for t in lines.texts()):
            assert time.monotonic() < deadline, lines.shown
            time.sleep(0.02)
        time.sleep(1.2)  # long enough for the line to count a second
        broker.start()
        handle, error = finished()
        assert error is None, repr(error)
        assert handle.placement is not None
        assert f"{RESTARTING}1 s (interrupt the kernel to stop waiting)" in lines.texts()
        assert lines.last_of(RESTARTING) == "gpushare: reconnected to the broker"
        with _probe(broker.socket) as probe:
            assert [lease.lease_id for lease in probe.status().leases] == [handle.lease_id]
    finally:
        session.close()


def test_a_wait_that_times_out_ends_its_line_with_stopped_waiting(start_broker):
    broker = start_broker()
    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
    session = GpuSession(broker.socket)
    lines = Lines()
    try:
        with pytest.raises(LeaseTimeout) as raised:
            session.acquire(LeaseOptions(memory_bytes=GIB, timeout_s=1.0), output=lines)
        assert "no GPU within 1 s" in str(raised.value)
        assert lines.last_of(RESTARTING) == (
            "gpushare: stopped waiting for the broker after 1 s (timed out)"
        )
    finally:
        session.close()


def test_a_ctrl_c_while_waiting_for_the_broker_ends_the_wait_at_once(start_broker):
    broker = start_broker()
    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
    session = GpuSession(broker.socket)
    lines = Lines()
    sent: list[float] = []

    def interrupt_once_waiting() -> None:
        deadline = time.monotonic() + 10
        while not any(t.startswith(RESTARTING) for t in lines.texts()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        time.sleep(0.3)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)  # what the kernel's interrupt is

    interrupter = threading.Thread(target=interrupt_once_waiting, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            session.acquire(LeaseOptions(memory_bytes=GIB), output=lines)  # no timeout
        ended = time.monotonic()
        assert sent, lines.shown
        assert ended - sent[0] < 1.0  # a bound on responsiveness, not a measure of speed
        last = lines.last_of(RESTARTING)
        assert last.startswith("gpushare: stopped waiting for the broker after ")
        assert last.endswith(" s (interrupted)")
    finally:
        interrupter.join(timeout=15)
        session.close()


def _stopping_broker(path: Path, answered: threading.Event) -> None:
    """A broker in its last moments, as SIGTERM leaves it: it welcomes, answers a request
    with "shutting down" (having made nothing of it), then closes and is gone."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)

    def converse(peer: socket.socket) -> None:
        frames = FrameReader()
        while not answered.is_set():
            data = peer.recv(65536)
            if not data:
                return  # a probe that only looked whether anyone listens
            frames.feed(data)
            while (body := frames.next_body()) is not None:
                message = decode_client_message(body)
                if isinstance(message, Hello):
                    peer.sendall(encode_frame(_welcome(message.seq)))
                elif isinstance(message, RequestLease):
                    stopping = Error(
                        reply_to=message.seq,
                        code=ErrorCode.UNAVAILABLE,
                        message="the broker is shutting down",
                    )
                    peer.sendall(encode_frame(stopping))
                    answered.set()

    def serve() -> None:
        with listener:
            while not answered.is_set():
                peer, _ = listener.accept()
                with peer:
                    converse(peer)
                    if answered.is_set():
                        time.sleep(0.3)  # it undoes what it applied, then closes
            path.unlink()

    threading.Thread(target=serve, daemon=True).start()


def _welcome(seq: int) -> Welcome:
    return Welcome(
        reply_to=seq, version=PROTOCOL_VERSION, broker_pid=os.getpid(), mode="user",
        session_id="S1-stopping", uid=os.getuid(), user="me", is_admin=False,
        inventory="simulated", inventory_description="a broker that is stopping",
        control_block="/nonexistent/S1-stopping.cb",
    )  # fmt: skip


def test_a_request_answered_shutting_down_waits_for_the_next_broker(start_broker):
    directory = short_tempdir()
    directory.chmod(0o700)
    answered = threading.Event()
    _stopping_broker(directory / "broker.sock", answered)
    session = GpuSession(directory / "broker.sock")
    lines = Lines()
    try:
        finished = _in_thread(
            lambda: session.acquire(LeaseOptions(memory_bytes=GIB, timeout_s=30), output=lines)
        )
        assert answered.wait(10), "the request never reached the stopping broker"
        while (directory / "broker.sock").exists():
            time.sleep(0.02)
        broker = start_broker(directory=directory)
        handle, error = finished()
        assert error is None, repr(error)
        assert handle.placement is not None
        with _probe(broker.socket) as probe:
            assert [lease.lease_id for lease in probe.status().leases] == [handle.lease_id]
    finally:
        session.close()


def test_a_session_with_no_broker_at_all_is_told_so_soon_and_without_a_restart_line():
    directory = short_tempdir()
    session = GpuSession(directory / "broker.sock")
    lines = Lines()
    try:
        began = time.monotonic()
        with pytest.raises(BrokerUnavailable) as raised:
            session.acquire(LeaseOptions(memory_bytes=GIB, timeout_s=30), output=lines)
        assert time.monotonic() - began < 10  # not the cell's 30 s: nothing to wait for
        assert "no such file" in str(raised.value)
        assert not [text for text in lines.texts() if "restarting" in text]
    finally:
        session.close()
        directory.rmdir()
