"""HTTP handlers of the gpushare server extension: the browser's only way to the broker.

Routes (all under the server's base URL, e.g. JupyterHub's ``/user/<name>/``):

``GET  gpushare/snapshot``  one :class:`~gpushare_ext.protocol.Snapshot` as JSON
``GET  gpushare/stream``    Server-Sent Events: ``event: snapshot`` about once a second,
                            ``event: unavailable`` when the broker goes away (then the
                            stream ends and the client reconnects); its broker
                            connection is renewed every ``IDENTITY_RENEWAL_S``
``GET  gpushare/history``   the last hour of every GPU (``?device=N``: of one, at full
                            resolution), a :class:`~gpushare_ext.protocol.GpuHistory`
``POST gpushare/admin``     ``{"action": "drain"|"undrain"|"cancel", "device"?, "lease_id"?}``

Every verb is ``@tornado.web.authenticated``.  The server talks to the broker as the
Unix user it runs as; the broker decides, from the socket's peer credentials, what that
user may see (others anonymised) and do (admin actions only for admins).  These
handlers decide nothing themselves and hold no state between requests.  Errors are
JSON ``{"error": code, "message": sentence}``; no reachable broker is a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import tornado.web
from jupyter_server.base.handlers import APIHandler
from tornado.iostream import StreamClosedError

from gpushare_ext.client import AsyncBrokerClient, BrokerError, BrokerUnavailable
from gpushare_ext.paths import how_a_broker_starts
from gpushare_ext.protocol import (
    ErrorCode,
    GpuHistory,
    Snapshot,
    encode_json,
    snapshot_to_builtins,
)

#: How long one broker round trip may take before the request fails with 503.
BROKER_TIMEOUT_S = 10.0

# HTTP status for each broker error code; anything unlisted is a 502 (the broker failed).
_STATUS_FOR_CODE: dict[ErrorCode, int] = {
    ErrorCode.PERMISSION: HTTPStatus.FORBIDDEN,
    ErrorCode.UNKNOWN_LEASE: HTTPStatus.NOT_FOUND,
    ErrorCode.INVALID: HTTPStatus.BAD_REQUEST,
    ErrorCode.MALFORMED: HTTPStatus.BAD_REQUEST,
    ErrorCode.POLICY: HTTPStatus.CONFLICT,
    ErrorCode.RATE_LIMITED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.NOT_SUPPORTED: HTTPStatus.NOT_IMPLEMENTED,
}


class AdminRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST gpushare/admin``: what the panel's admin buttons can ask for."""

    action: Literal["drain", "undrain", "cancel"]
    device: Annotated[int, msgspec.Meta(ge=0, le=1023)] | None = None
    lease_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None


def no_broker_message(socket_path: Path, reason: str) -> str:
    """The sentence a user reads when the server cannot reach a broker."""
    return (
        f"No GPU broker reachable at {socket_path}: {reason}. "
        f"{how_a_broker_starts(socket_path)}; this panel shows it as soon as it answers."
    )


class GpushareHandler(APIHandler):
    """Common plumbing: where the broker is, and errors as JSON with a clear message."""

    @property
    def socket_path(self) -> Path:
        return Path(self.settings["gpushare_socket_path"]())

    def fail(self, status: int, code: str, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": code, "message": message}))

    def finish_fresh_json(self, body: bytes | str) -> None:
        """Answer with ``body`` as JSON that no cache may keep (it is the broker's now)."""
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(body)

    def fail_for(self, exc: BrokerError) -> None:
        if isinstance(exc, BrokerUnavailable):
            self.fail(
                HTTPStatus.SERVICE_UNAVAILABLE,
                ErrorCode.UNAVAILABLE.value,
                no_broker_message(self.socket_path, exc.message),
            )
            return
        status = _STATUS_FOR_CODE.get(exc.code, HTTPStatus.BAD_GATEWAY)
        self.fail(status, exc.code.value, exc.message)

    async def with_broker(self, work: Callable[[AsyncBrokerClient], Awaitable[object]]) -> object:
        """Run ``work`` on a fresh broker connection; BrokerError on any failure or timeout."""

        async def run() -> object:
            async with AsyncBrokerClient(self.socket_path, client="server") as client:
                return await work(client)

        try:
            return await asyncio.wait_for(run(), BROKER_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise BrokerUnavailable(
                f"the broker did not answer within {BROKER_TIMEOUT_S:g} s"
            ) from None
        except OSError as exc:
            raise BrokerUnavailable(f"connection to the broker failed: {exc}") from None


class SnapshotHandler(GpushareHandler):
    """``GET gpushare/snapshot``: the broker's view for this user, once."""

    @tornado.web.authenticated
    async def get(self) -> None:
        try:
            snapshot = await self.with_broker(lambda client: client.status())
        except BrokerError as exc:
            self.fail_for(exc)
            return
        assert isinstance(snapshot, Snapshot)
        self.finish_fresh_json(encode_json(snapshot_to_builtins(snapshot)))


MAX_DEVICE_INDEX = 1023


class HistoryHandler(GpushareHandler):
    """``GET gpushare/history[?device=N]``: the dashboard's last hour, for this user."""

    @tornado.web.authenticated
    async def get(self) -> None:
        text = self.get_argument("device", "")
        if text and not (text.isdecimal() and text.isascii() and int(text) <= MAX_DEVICE_INDEX):
            self.fail(HTTPStatus.BAD_REQUEST, "invalid", "device must be a GPU index (0, 1, ...)")
            return
        device = int(text) if text else None
        try:
            history = await self.with_broker(lambda client: client.history(device))
        except BrokerError as exc:
            self.fail_for(exc)
            return
        assert isinstance(history, GpuHistory)
        self.finish_fresh_json(encode_json(history))


#: How long the stream keeps one broker connection.  The broker learns who is at the
#: other end (the user's name and groups: an admin or not, whose names they may see) when
#: a connection opens, from the host's user database, as it does for every ``gpushare``
#: command.  A panel stays open for days, so the stream opens a new connection this often:
#: a user added to an admin group (or taken out of one) sees the panel change within this
#: time, without a reload, as the command line changes at once.
IDENTITY_RENEWAL_S = 10.0


class StreamHandler(GpushareHandler):
    """``GET gpushare/stream``: snapshots as Server-Sent Events, from broker watches.

    The first event is sent at once (a status request), the rest as the broker's watch
    delivers them.  Every IDENTITY_RENEWAL_S the watch moves to a new broker connection,
    so what the broker decides from the user's identity is never older than that.  The
    broker connection lives no longer than the HTTP response: closing the browser tab
    cancels it.
    """

    _pump: asyncio.Task | None = None
    _client: AsyncBrokerClient | None = None

    @tornado.web.authenticated
    async def get(self) -> None:
        try:
            interval_s = min(60.0, max(0.2, float(self.get_argument("interval", "1"))))
        except ValueError:
            self.fail(HTTPStatus.BAD_REQUEST, "invalid", "interval must be a number of seconds")
            return
        try:
            first = await self._connect()
        except BrokerError as exc:
            self.fail_for(exc)
            return
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")  # no proxy buffering (nginx, hub proxies)
        self._pump = asyncio.ensure_future(self._follow(first, interval_s))
        try:
            await self._pump
        except (asyncio.CancelledError, StreamClosedError):
            pass  # the browser went away
        finally:
            await self._disconnect()
        with contextlib.suppress(StreamClosedError):
            self.finish()

    async def _connect(self) -> Snapshot:
        """A new broker connection (the broker reads the user's identity now); its status."""
        client = AsyncBrokerClient(self.socket_path, client="server")
        try:
            await asyncio.wait_for(client.connect(), BROKER_TIMEOUT_S)
            first = await asyncio.wait_for(client.status(), BROKER_TIMEOUT_S)
        except (BrokerError, OSError, asyncio.TimeoutError) as exc:
            await client.close()
            if isinstance(exc, BrokerError):
                raise
            raise BrokerUnavailable(str(exc) or type(exc).__name__) from None
        self._client = client
        return first

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _follow(self, first: Snapshot, interval_s: float) -> None:
        snapshot = first
        try:
            while True:
                await self._event("snapshot", encode_json(snapshot_to_builtins(snapshot)))
                assert self._client is not None
                renew_at = time.monotonic() + IDENTITY_RENEWAL_S
                watch = self._client.watch(interval_s)
                async for snapshot in watch:
                    await self._event("snapshot", encode_json(snapshot_to_builtins(snapshot)))
                    if time.monotonic() >= renew_at:
                        break
                else:
                    return  # the broker ended the watch: the stream ends, the panel reconnects
                await watch.aclose()
                # The old connection goes first: a user's connections are counted.
                await self._disconnect()
                snapshot = await self._connect()
        except StreamClosedError:
            raise  # the browser went away: nobody to tell
        except (BrokerError, OSError) as exc:
            message = no_broker_message(self.socket_path, str(exc) or type(exc).__name__)
            body = json.dumps({"error": ErrorCode.UNAVAILABLE.value, "message": message})
            await self._event("unavailable", body.encode())

    async def _event(self, name: str, data: bytes) -> None:
        self.write(b"event: " + name.encode() + b"\ndata: " + data + b"\n\n")
        await self.flush()

    def on_connection_close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        super().on_connection_close()


class AdminHandler(GpushareHandler):
    """``POST gpushare/admin``: drain / undrain a device, cancel a request (admins only).

    The broker checks that the server's user is an admin; a refusal comes back as 403.
    """

    @tornado.web.authenticated
    async def post(self) -> None:
        try:
            request = msgspec.json.decode(self.request.body, type=AdminRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.fail(HTTPStatus.BAD_REQUEST, "invalid", f"invalid admin request: {exc}")
            return
        if request.action in ("drain", "undrain") and request.device is None:
            self.fail(HTTPStatus.BAD_REQUEST, "invalid", f"{request.action} needs a device index")
            return
        if request.action == "cancel" and request.lease_id is None:
            self.fail(HTTPStatus.BAD_REQUEST, "invalid", "cancel needs a lease_id")
            return
        try:
            detail = await self.with_broker(
                lambda client: client.admin(
                    request.action, device=request.device, lease_id=request.lease_id
                )
            )
        except BrokerError as exc:
            self.fail_for(exc)
            return
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"ok": True, "detail": str(detail or "")}))


def handlers(base_url: str) -> list[tuple[str, type[GpushareHandler]]]:
    """The extension's routes under ``base_url``."""
    from jupyter_server.utils import url_path_join

    return [
        (url_path_join(base_url, "gpushare", "snapshot"), SnapshotHandler),
        (url_path_join(base_url, "gpushare", "stream"), StreamHandler),
        (url_path_join(base_url, "gpushare", "history"), HistoryHandler),
        (url_path_join(base_url, "gpushare", "admin"), AdminHandler),
    ]
