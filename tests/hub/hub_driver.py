"""Drive a real JupyterHub from a test: its REST API, users' servers, and their kernels.

Nothing here fakes Jupyter: the hub and proxy are the real programs, the single-user
servers are started by the hub's LocalProcessSpawner as the users, and code runs in
their kernels through each server's REST API (``POST /user/<name>/api/sessions``) and the
kernel's websocket (``/api/kernels/<id>/channels``, the JSON form of the Jupyter
messaging protocol), with the user's own API token.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import requests
import websocket

REQUEST_TIMEOUT_S = 15


class HubError(AssertionError):
    """The hub or a user's server did not do what the test asked."""


@dataclass
class Hub:
    """A running hub reached at ``url`` with a service token holding admin scopes."""

    url: str
    token: str

    def api(self, method: str, path: str, **kwargs) -> requests.Response:
        response = requests.request(
            method,
            f"{self.url}/hub/api{path}",
            headers={"Authorization": f"token {self.token}"},
            timeout=REQUEST_TIMEOUT_S,
            **kwargs,
        )
        if response.status_code >= 400:
            raise HubError(f"{method} /hub/api{path}: {response.status_code} {response.text}")
        return response

    def start_server(self, name: str) -> None:
        """Ask the hub to spawn ``name``'s server (returns before it is ready)."""
        self.api("POST", f"/users/{name}/server")

    def wait_ready(self, name: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.api("GET", f"/users/{name}").json()
            server = model.get("servers", {}).get("")
            if server and server.get("ready"):
                return
            time.sleep(0.25)
        raise HubError(f"{name}'s server was not ready within {timeout} s")

    def stop_server(self, name: str) -> None:
        with contextlib.suppress(HubError, requests.RequestException):
            self.api("DELETE", f"/users/{name}/server")

    def user_token(self, name: str) -> str:
        """A fresh API token of ``name``, good for their own server only."""
        reply = self.api(
            "POST",
            f"/users/{name}/tokens",
            json={
                "note": "gpushare e2e",
                "expires_in": 900,
                "scopes": [f"access:servers!user={name}"],
            },
        )
        return reply.json()["token"]

    def server(self, name: str) -> UserServer:
        return UserServer(hub=self, name=name, token=self.user_token(name))


@dataclass
class UserServer:
    """One user's single-user server, reached through the proxy with that user's token."""

    hub: Hub
    name: str
    token: str

    @property
    def base(self) -> str:
        return f"{self.hub.url}/user/{self.name}"

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        return requests.request(
            method,
            f"{self.base}{path}",
            headers={"Authorization": f"token {self.token}"},
            timeout=REQUEST_TIMEOUT_S,
            **kwargs,
        )

    def snapshot(self) -> dict:
        """The broker's snapshot as this user sees it, from the gpushare server extension."""
        response = self.request("GET", "/gpushare/snapshot")
        if response.status_code != 200:
            raise HubError(
                f"{self.name}: GET gpushare/snapshot: {response.status_code} {response.text}"
            )
        return response.json()

    def open_notebook(self, path: str) -> Kernel:
        """Open ``path`` as a notebook session (a new kernel) and connect to its channels."""
        reply = self.request(
            "POST",
            "/api/sessions",
            json={"path": path, "name": path, "type": "notebook", "kernel": {"name": "python3"}},
        )
        if reply.status_code not in (200, 201):
            raise HubError(f"{self.name}: POST api/sessions: {reply.status_code} {reply.text}")
        kernel_id = reply.json()["kernel"]["id"]
        return Kernel.connect(self, kernel_id)


@dataclass
class Execution:
    """One ``execute_request``: its outputs arrive while it runs."""

    msg_id: str
    code: str
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list[dict] = field(default_factory=list)
    reply: dict | None = None
    idle: bool = False

    @property
    def text(self) -> str:
        """Everything the cell showed: streams, displays (latest version of each), results."""
        latest: dict[str, str] = {}
        parts: list[str] = []
        for output in list(self.outputs):
            kind = output["msg_type"]
            content = output["content"]
            if kind == "stream":
                parts.append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                text = content.get("data", {}).get("text/plain", "")
                key = content.get("transient", {}).get("display_id")
                if key:
                    if key not in latest:
                        parts.append(f"\0{key}\0")
                    latest[key] = text
                else:
                    parts.append(text)
            elif kind == "error":
                parts.append(f"{content['ename']}: {content['evalue']}")
        joined = "\n".join(parts)
        for key, text in latest.items():
            joined = joined.replace(f"\0{key}\0", text)
        return joined

    @property
    def all_display_texts(self) -> list[str]:
        """Every version of every display, updates included (notices replace each other)."""
        return [
            o["content"].get("data", {}).get("text/plain", "")
            for o in list(self.outputs)
            if o["msg_type"] in ("display_data", "update_display_data")
        ]

    def wait(self, timeout: float) -> Execution:
        if not self.done.wait(timeout):
            raise HubError(f"cell did not finish within {timeout} s; so far:\n{self.text}")
        return self

    def succeeded(self) -> bool:
        return self.reply is not None and self.reply["content"]["status"] == "ok"

    def wait_for_text(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text
            if needle in text:
                return text
            if self.done.is_set():
                break
            time.sleep(0.05)
        raise HubError(f"{needle!r} not shown within {timeout} s; the cell shows:\n{self.text}")


class Kernel:
    """A kernel's websocket: send ``execute_request`` messages, collect what comes back."""

    def __init__(self, server: UserServer, kernel_id: str, ws: websocket.WebSocket) -> None:
        self.server = server
        self.kernel_id = kernel_id
        self.session = uuid.uuid4().hex
        self._ws = ws
        self._executions: dict[str, Execution] = {}
        self._orphans: dict[str, list[dict]] = defaultdict(list)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, server: UserServer, kernel_id: str) -> Kernel:
        url = server.base.replace("http://", "ws://", 1)
        ws = websocket.create_connection(
            f"{url}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}",
            header=[f"Authorization: token {server.token}"],
            timeout=REQUEST_TIMEOUT_S,
        )
        ws.settimeout(None)
        return cls(server, kernel_id, ws)

    def _read_loop(self) -> None:
        while True:
            try:
                raw = self._ws.recv()
            except Exception:
                return
            if not raw:
                return
            message = json.loads(raw)
            parent = message.get("parent_header", {}).get("msg_id")
            with self._lock:
                execution = self._executions.get(parent)
                if execution is None:
                    self._orphans[parent].append(message)
                    continue
            self._deliver(execution, message)

    @staticmethod
    def _deliver(execution: Execution, message: dict) -> None:
        kind = message["msg_type"]
        if message["channel"] == "shell" and kind == "execute_reply":
            execution.reply = message
        elif message["channel"] == "iopub":
            if kind == "status" and message["content"]["execution_state"] == "idle":
                execution.idle = True
            elif kind in (
                "stream",
                "display_data",
                "update_display_data",
                "execute_result",
                "error",
            ):
                execution.outputs.append({"msg_type": kind, "content": message["content"]})
        if execution.reply is not None and execution.idle:
            execution.done.set()

    def start(self, code: str) -> Execution:
        """Send a cell for execution and return at once; outputs arrive as it runs."""
        msg_id = uuid.uuid4().hex
        execution = Execution(msg_id=msg_id, code=code)
        with self._lock:
            self._executions[msg_id] = execution
        message = {
            "header": {
                "msg_id": msg_id,
                "msg_type": "execute_request",
                "username": self.server.name,
                "session": self.session,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": "5.3",
            },
            "parent_header": {},
            "metadata": {},
            "content": {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
            "channel": "shell",
            "buffers": [],
        }
        with self._send_lock:
            self._ws.send(json.dumps(message))
        with self._lock:
            early = self._orphans.pop(msg_id, [])
        for old in early:
            self._deliver(execution, old)
        return execution

    def run(self, code: str, timeout: float = 60) -> Execution:
        """Execute a cell and wait for it; fail with its output if it raised."""
        execution = self.start(code).wait(timeout)
        if not execution.succeeded():
            raise HubError(
                f"cell failed in {self.server.name}'s kernel:\n{code}\n---\n{execution.text}"
            )
        return execution

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ws.close()
