"""The broker's wire protocol: typed, versioned messages and length-prefixed frames.

One module, imported by both ends (broker, notebook runtime, CLI, server extension).

Framing: every message is one frame, a 4-byte big-endian unsigned length followed by
that many bytes of JSON (msgspec).  Frames longer than :data:`MAX_FRAME_BYTES` are
refused before they are read.  Every message is a msgspec Struct tagged by its
``type`` field; decoding validates types and ranges, so a message that decodes is
well-formed.  Anything else (truncated, oversized, not JSON, unknown type, wrong field
types, wrong protocol version, a message before ``hello``) is answered with an
:class:`Error` carrying an :class:`ErrorCode` and a sentence for the user, and
changes nothing in the broker.

Conversation: the client sends :class:`Hello` first; the broker answers
:class:`Welcome`.  Requests carry a client-chosen ``seq``; direct replies carry it back
in ``reply_to``.  Notices the broker sends on its own (a queued lease granted, a
preemption, a resume, a state update for a watcher) have ``reply_to = 0``.

Identity (uid, gid, pid) never comes from these messages: the broker reads it from the
socket's peer credentials.  ``Hello.pid`` is informational and must match.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Literal

import msgspec

from gpushare_ext.devices import DeviceInfo
from gpushare_ext.errors import GpushareError
from gpushare_ext.lease_state import LeaseState, PreemptionLevel

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 256 * 1024
_LENGTH = struct.Struct(">I")

Priority = Annotated[int, msgspec.Meta(ge=0, le=299)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=1 << 50)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << 53))]
ShortText = Annotated[str, msgspec.Meta(max_length=256)]
LeaseId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
# A gang (one request for several slices, trained across them) has at most this many
# ranks: more processes than a host has slices gain nothing and cost every neighbour.
MAX_RANKS = 64
Ranks = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
RANK_SEPARATOR = "."  # a gang "L7" runs as the leases "L7.0", "L7.1", ...


def member_id(gang: str, rank: int) -> str:
    """The lease id of ``gang``'s rank ``rank``."""
    return f"{gang}{RANK_SEPARATOR}{rank}"


def split_member_id(lease_id: str) -> tuple[str, int] | None:
    """``("L7", 2)`` for ``"L7.2"``; None for a lease that is no gang's rank."""
    gang, separator, rank = lease_id.rpartition(RANK_SEPARATOR)
    if not separator or not gang or not rank.isdecimal() or not rank.isascii():
        return None
    return gang, int(rank)


# Priority classes: a request names a class ("high") or a number 0..299; the class of a
# number is its hundred (0-99 low, 100-199 normal, 200-299 high).  Names map to the
# middle of their band so a number can rank just above or below a class.
PRIORITY_CLASSES: dict[str, int] = {"low": 50, "normal": 150, "high": 250}


def priority_value(priority: str | int) -> int:
    """Number of a priority given as a class name or a number; ValueError if neither."""
    if isinstance(priority, bool):
        raise ValueError("priority must be low, normal, high or a number 0-299")
    if isinstance(priority, int):
        if not 0 <= priority <= 299:
            raise ValueError(f"priority {priority} is outside 0-299")
        return priority
    text = str(priority).strip().lower()
    if text in PRIORITY_CLASSES:
        return PRIORITY_CLASSES[text]
    try:
        return priority_value(int(text))
    except ValueError:
        raise ValueError(
            f"priority {priority!r} is not low, normal, high or a number 0-299"
        ) from None


def priority_class(value: int) -> str:
    return ("low", "normal", "high")[min(max(value, 0), 299) // 100]


def describe_priority(value: int) -> str:
    name = priority_class(value)
    return name if PRIORITY_CLASSES[name] == value else f"{name} ({value})"


class ErrorCode(str, enum.Enum):
    """Why the broker refused a message; clients branch on these, users read ``message``."""

    MALFORMED = "malformed"  # not JSON, truncated, wrong field types or values
    TOO_LARGE = "too_large"  # frame over MAX_FRAME_BYTES
    UNKNOWN_MESSAGE = "unknown_message"  # a type this broker does not know
    VERSION = "version"  # protocol version mismatch
    OUT_OF_ORDER = "out_of_order"  # e.g. a request before hello, a second hello
    PERMISSION = "permission"  # not your session, or not an admin
    UNKNOWN_LEASE = "unknown_lease"  # no such lease (for you)
    INVALID = "invalid"  # well-formed but impossible: negative memory, bad device
    POLICY = "policy"  # refused by policy: quota, max leases, max priority
    RATE_LIMITED = "rate_limited"  # too many requests or connections from this uid
    UNAVAILABLE = "unavailable"  # draining, shutting down, or device gone
    NOT_SUPPORTED = "not_supported"  # e.g. checkpoint lock on an MPS client
    INTERNAL = "internal"


def level_word(level: int) -> str:
    """A rung in one word ("gate", "yield" ... "evict"), as the broker's log and the
    timeline name it; "?" for a number no rung has."""
    try:
        return PreemptionLevel(level).name.lower()
    except ValueError:
        return "?"


# The rungs as the cell's pause line names them (the broker's status names them too).
LEVEL_NAMES: dict[PreemptionLevel, str] = {
    PreemptionLevel.GATE: "the gate",
    PreemptionLevel.YIELD: "the yield flag",
    PreemptionLevel.ABORT: "the abort flag",
    PreemptionLevel.LOCK: "the process lock",
    PreemptionLevel.EVICT: "the checkpoint to host",
}


def applied_level(asked: PreemptionLevel, simulated: bool) -> PreemptionLevel:
    """The rung that really holds a session the broker paused at ``asked``.

    A simulated GPU has no process to flag, lock or checkpoint: its broker records those
    levels, but only the gate holds the session (its launch points wait on it).  The
    broker's status note and the cell's pause line both go by this, so they agree.
    """
    return PreemptionLevel.GATE if simulated else asked


class SliceWish(str, enum.Enum):
    AUTO = "auto"  # broker decides: a MIG instance where MIG is on, else a share of a GPU
    MIG = "mig"  # only a MIG instance
    SHARED = "shared"  # a software slice of a whole GPU (memory quota + SM share)
    EXCLUSIVE = "exclusive"  # a whole GPU or MIG instance to itself


# ---------------------------------------------------------------- client -> broker


class ClientMessage(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    seq: Seq = 0


class Hello(ClientMessage, tag="hello"):
    version: int
    pid: int
    client: Literal["kernel", "cli", "server", "widget", "bench"] = "kernel"
    kernel_id: ShortText = ""
    notebook: ShortText = ""
    # Leases this client held before the broker restarted; the broker takes them back
    # if its journal agrees they are this pid's.
    reclaim: list[LeaseId] = []
    # The GPUs this process can reach (GPU or MIG UUIDs, or host indices), where its
    # container sees only some of the host's (a Kubernetes device plugin allocated them):
    # its leases are placed only there.  None: every GPU of the host is reachable.
    visible_devices: Annotated[list[ShortText], msgspec.Meta(max_length=64)] | None = None


class Capabilities(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the session can be stopped, so the broker picks the cheapest ladder level."""

    gate: bool = False  # the runtime enqueues waits on the gate word at its launch points
    yield_flag: bool = False  # instrumented kernels poll a device yield flag (levels 1-2)
    instrumented_only: bool = False  # all its GPU work is instrumented: no need to lock
    lockable: bool = True  # cuCheckpointProcessLock works for it (False for MPS clients)


class RequestLease(ClientMessage, tag="request_lease"):
    priority: Priority = PRIORITY_CLASSES["normal"]
    memory_bytes: Bytes | None = None  # None: the policy's default
    slice: SliceWish = SliceWish.AUTO
    device: ShortText = "auto"  # "auto", a device index, a GPU or MIG UUID
    sm_share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    capabilities: Capabilities = Capabilities()
    label: ShortText = ""  # e.g. the cell's first line, shown in the queue
    # More than one: a gang, granted all at once (each rank its own slice of
    # ``memory_bytes`` and ``sm_share``), paused and resumed as one, released as one.
    ranks: Ranks = 1


class Release(ClientMessage, tag="release"):
    lease_id: LeaseId


class Heartbeat(ClientMessage, tag="heartbeat"):
    pass


class CellActivity(ClientMessage, tag="cell_activity"):
    """A cell of this session started (``running``) or ended, marked or not: a session
    with a cell running is never parked, and idle time counts from the last one's end.
    The broker does not answer it.  ``unparkable`` says why this process must not be
    parked ("" when it may be): one that opened another process's GPU memory cannot be
    restored after a checkpoint.  A session is parked only once it has said this.
    ``parkable_bytes``: the device memory its launch shim can park itself, at the host
    link's speed and in part (0: none; then a park moves all of it, by checkpoint)."""

    running: bool
    unparkable: ShortText = ""
    parkable_bytes: Bytes = 0


class Park(ClientMessage, tag="park"):
    """Park the idle notebook of process ``pid`` now (your own; anyone's for admins).
    Answered with ``ok`` naming what goes to the host, or an error saying why not."""

    pid: Annotated[int, msgspec.Meta(ge=1)]


class AttachRanks(ClientMessage, tag="attach_ranks"):
    """The worker processes of gang ``lease_id`` started: ``pids[k]`` runs rank k.
    Preemption, the memory watchdog and recovery act on those processes from now on.
    Each must be a descendant of the asking process and belong to its user; answered
    with ``ok``."""

    lease_id: LeaseId
    pids: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(max_length=MAX_RANKS)]


class Restore(ClientMessage, tag="restore"):
    """Give this session's parked memory back (before its next cell), or, ``cancel``,
    stop waiting for it.  Answered with ``ok``; the restore itself ends with ``resume``
    (or ``revoked`` if it failed), and ``queued`` notices while it waits."""

    lease_id: LeaseId
    cancel: bool = False


class StatusRequest(ClientMessage, tag="status"):
    pass


class Watch(ClientMessage, tag="watch"):
    interval_s: Annotated[float, msgspec.Meta(ge=0.2, le=60.0)] = 1.0


class Unwatch(ClientMessage, tag="unwatch"):
    pass


class HistoryRequest(ClientMessage, tag="history"):
    """The dashboard's last hour of every GPU, or of GPU ``device`` only (at full
    resolution: a reply for many GPUs is thinned to fit a frame)."""

    device: Annotated[int, msgspec.Meta(ge=0, le=1023)] | None = None


class RegisterYieldFlag(ClientMessage, tag="register_yield_flag"):
    """The session's device yield flag, exported as a CUDA IPC memory handle (hex)."""

    lease_id: LeaseId
    device_index: int
    ipc_handle_hex: Annotated[str, msgspec.Meta(max_length=512, pattern="^[0-9a-f]*$")]
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0


class AdminAction(str, enum.Enum):
    DRAIN = "drain"
    UNDRAIN = "undrain"
    CANCEL = "cancel"  # cancel (or revoke) someone's lease
    SET_POLICY = "set_policy"
    RELOAD_POLICY = "reload_policy"


class Admin(ClientMessage, tag="admin"):
    action: AdminAction
    device: int | None = None
    lease_id: LeaseId | None = None
    policy_toml: Annotated[str, msgspec.Meta(max_length=64 * 1024)] | None = None


class Chaos(ClientMessage, tag="chaos"):
    """Admins (and tests): pause the session of ``pid`` at random moments, every
    ``every_ms`` for ``pause_ms`` (each a [low, high] range) at one of ``levels``, for
    ``duration_s`` (None: until stopped); ``stop`` ends it.  See broker/hands/chaos.py."""

    pid: int
    every_ms: tuple[float, float] = (5.0, 50.0)
    pause_ms: tuple[float, float] = (1.0, 20.0)
    levels: Annotated[tuple[PreemptionLevel, ...], msgspec.Meta(max_length=5)] = (
        PreemptionLevel.GATE,
        PreemptionLevel.YIELD,
        PreemptionLevel.LOCK,
    )
    duration_s: float | None = None
    seed: int = 0
    stop: bool = False


ClientMessageUnion = (
    Hello
    | RequestLease
    | Release
    | Heartbeat
    | StatusRequest
    | Watch
    | Unwatch
    | HistoryRequest
    | RegisterYieldFlag
    | Admin
    | CellActivity
    | Restore
    | Park
    | AttachRanks
    | Chaos
)

# ---------------------------------------------------------------- broker -> client


class BrokerMessage(msgspec.Struct, tag_field="type", kw_only=True):
    reply_to: int = 0


class Welcome(BrokerMessage, tag="welcome"):
    version: int
    broker_pid: int
    mode: Literal["system", "user"]
    session_id: str
    uid: int
    user: str
    is_admin: bool
    inventory: str  # "nvml" or "simulated"
    inventory_description: str
    control_block: str  # path of this session's control block (mode 0600, owned by uid)
    reclaimed: list[str] = []


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a lease runs: a whole device, or one MIG instance of it."""

    device_index: int
    device_uuid: str
    mig_uuid: str | None = None
    mig_profile: str | None = None
    memory_bytes: int
    sm_share: float = 1.0
    max_blocks_per_sm_share: int | None = None  # persistent-block cap for transformed kernels
    mps: bool = False  # the host runs an MPS daemon: apply the share as MPS limits

    @property
    def cuda_visible_devices(self) -> str:
        return self.mig_uuid or self.device_uuid


class RankPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of a gang: the lease it runs under and where."""

    lease_id: str
    placement: Placement


class Granted(BrokerMessage, tag="granted"):
    lease_id: str
    placement: Placement  # of a gang: its rank 0's
    priority: int
    notice: str = ""  # e.g. "priority lowered to normal by policy"
    ranks: list[RankPlacement] = []  # a gang's ranks in order; empty for one lease


# Queue places a ``queued`` notice tells exactly; further back it tells a round number.
EXACT_PLACES = 10


def told_place(position: int) -> int:
    """A queue place (1-based) as a ``queued`` notice tells it: exact up to
    :data:`EXACT_PLACES`, further back rounded up to the next of 20, 50, 100, 200, 500,
    1,000, 2,000 ..., so the request stands at that place or nearer.

    Every grant moves every waiter behind it up one place; told exactly, that was a
    notice to each of them.  Rounded, a waiter far back hears of it only when its place
    crosses one of those numbers: a grant at the head of a thousand waiters tells the
    first ten and five more.  A place past :data:`EXACT_PLACES` means "that place or
    nearer", and is best worded so ("within the first 200")."""
    if position <= EXACT_PLACES:
        return position
    scale = 10
    while True:
        for top in (scale, 2 * scale, 5 * scale):
            if position <= top:
                return top
        scale *= 10


class Queued(BrokerMessage, tag="queued"):
    lease_id: str
    position: int  # as :func:`told_place` tells it: exact near the head, rounded up behind
    waiting_for: str  # who holds what it needs, anonymised unless it is you or you are admin
    holder_priority: int | None = None
    estimate_s: float | None = None
    reason: str = ""
    notice: str = ""  # what the policy changed in the request (as in ``granted``)
    # Memory being freed for it (sessions evicted or parked to the host); its estimate is
    # then how long that takes at the rate the broker measured, not a holder's habit.
    freeing_bytes: int | None = None


class Preempt(BrokerMessage, tag="preempt"):
    lease_id: str
    level: PreemptionLevel  # the level asked
    held_by: PreemptionLevel  # the rung that really holds it (a simulated GPU's gate)
    state: LeaseState  # the state the lease is in from this notice on
    reason: str
    for_user: str  # anonymised


class Resume(BrokerMessage, tag="resume"):
    lease_id: str
    paused_s: float
    note: str = ""  # set when the pause never took effect (e.g. the lock is unsupported)


# The label of the lease that holds a parked session's memory (status, widget, panel).
PARKED_LABEL = "parked idle session"


class Parked(BrokerMessage, tag="parked"):
    """The session was idle and its GPU memory was checkpointed to host memory; it is
    restored (``restore``) before the session's next GPU work."""

    lease_id: str  # the park, named in ``restore``
    memory_bytes: int
    device_index: int
    reason: str


class Revoked(BrokerMessage, tag="revoked"):
    lease_id: str
    reason: str


class Released(BrokerMessage, tag="released"):
    lease_id: str
    held_s: float


class Refused(BrokerMessage, tag="refused"):
    lease_id: str
    code: ErrorCode
    message: str


class Ok(BrokerMessage, tag="ok"):
    detail: str = ""


class Error(BrokerMessage, tag="error"):
    code: ErrorCode
    message: str


# ---- the snapshot shared by status, watch, the widget, the panel and metrics


class LeaseView(msgspec.Struct, kw_only=True):
    lease_id: str
    user: str  # name for your own and for admins, "user-xxxx" otherwise
    own: bool
    priority: int
    state: LeaseState
    device_index: int | None
    mig_uuid: str | None
    memory_bytes: int
    sm_share: float
    since_s: float  # seconds in the current state
    waited_s: float  # seconds spent queued before the grant
    position: int | None = None  # queue position (1-based) when queued
    reason: str = ""  # why queued / paused / evicted
    label: str = ""
    pid: int | None = None  # only for your own leases and admins
    notebook: str = ""  # only for your own leases and admins
    preemption_level: int | None = None
    estimate_s: float | None = None  # queued: seconds until the GPU is likely free, now
    # A gang's rank: the request id ("L7") its ranks share, and its rank number; "" and
    # None for a single lease.  Views group the ranks by ``gang`` into one request.
    gang: str = ""
    rank: int | None = None


class TimelinePause(msgspec.Struct, kw_only=True):
    start: float
    end: float | None = None  # None: still paused
    level: int  # the highest ladder level applied (0 gate ... 4 evict)


class TimelineSpan(msgspec.Struct, kw_only=True):
    """A lease on a device's timeline: from its grant to its end, with its pauses."""

    lease_id: str
    user: str  # as in LeaseView: a name for your own and for admins
    own: bool
    priority: int
    start: float
    end: float | None = None  # None: still held
    pauses: list[TimelinePause] = []
    gang: str = ""  # as in LeaseView: the request id of a gang's rank, "" for one lease
    rank: int | None = None


class DeviceView(msgspec.Struct, kw_only=True):
    info: DeviceInfo
    drained: bool
    memory_used_mib: int
    memory_leased_mib: int
    utilization_pct: int
    utilization_history: list[int]
    holders: list[str]  # lease ids running or paused here
    # Memory NVML sees held here beyond what leases declare, per user ("other processes"
    # for processes of no session): idle notebooks' arrays, contexts, unknown programs.
    memory_outside_leases_mib: dict[str, int] = {}
    timeline: list[TimelineSpan] = []  # the last Snapshot.timeline_window_s seconds


class Snapshot(msgspec.Struct, kw_only=True):
    host: str
    node: str
    broker_pid: int
    mode: str
    inventory: str
    inventory_description: str
    time: float
    you: str
    is_admin: bool
    devices: list[DeviceView]
    leases: list[LeaseView]
    queue_by_priority: dict[str, int]
    notes: list[str] = []  # e.g. "level 3 unsupported for MPS clients"
    timeline_window_s: float = 0.0  # how far back DeviceView.timeline reaches


# ---- the dashboard's last hour (HistoryRequest)


class MemorySeries(msgspec.Struct, kw_only=True):
    """What one user held on a GPU over time, of one kind, in MiB: ``leased`` in running
    or paused leases, ``outside`` leases (NVML's reading beyond them), ``parked`` on the
    host for an idle session."""

    user: str  # as in LeaseView: a name for your own and for admins, "user-xxxx" otherwise
    own: bool
    kind: Literal["leased", "outside", "parked"]
    mib: list[int]  # one per DeviceHistory.times


class HistorySpan(TimelineSpan, kw_only=True):
    """A lease on the dashboard's timeline: a timeline span with its label."""

    label: str = ""  # only for your own leases and admins, as plain text


class DeviceHistory(msgspec.Struct, kw_only=True):
    index: int
    name: str
    memory_total_mib: int
    times: list[float]  # when each sample was taken (Unix time), oldest first
    utilization_pct: list[int]
    queued: list[int]  # requests waiting that this GPU could serve
    memory: list[MemorySeries] = []
    spans: list[HistorySpan] = []


class GpuHistory(msgspec.Struct, kw_only=True):
    time: float
    window_s: float  # how far back the series and the spans reach
    sample_every_s: float  # the spacing of the samples sent (wider when thinned to fit)
    you: str
    is_admin: bool
    devices: list[DeviceHistory]


class HistoryReply(BrokerMessage, tag="history_reply"):
    history: GpuHistory


class StatusReply(BrokerMessage, tag="status_reply"):
    snapshot: Snapshot


class StateUpdate(BrokerMessage, tag="state_update"):
    snapshot: Snapshot


BrokerMessageUnion = (
    Welcome
    | Granted
    | Queued
    | Preempt
    | Resume
    | Revoked
    | Parked
    | Released
    | Refused
    | Ok
    | Error
    | StatusReply
    | StateUpdate
    | HistoryReply
)


class ProtocolError(GpushareError):
    """A frame or message that cannot be accepted; ``code`` and ``message`` go to the peer."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_client_decoder = msgspec.json.Decoder(ClientMessageUnion)
_broker_decoder = msgspec.json.Decoder(BrokerMessageUnion)
_encoder = msgspec.json.Encoder()
_KNOWN_CLIENT_TYPES = {
    cls.__struct_config__.tag
    for cls in ClientMessageUnion.__args__  # type: ignore[attr-defined]
}


def encode_frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(body)} bytes is over the limit")
    return _LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """Length announced by a 4-byte header; ProtocolError if over the limit."""
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"frame of {length} bytes announced; the limit is {MAX_FRAME_BYTES}",
        )
    return length


MAX_ERROR_ECHO = 64  # characters of a client's own text an error quotes back


def _quoted(text: str) -> str:
    return repr(text if len(text) <= MAX_ERROR_ECHO else text[:MAX_ERROR_ECHO] + "...")


def decode_client_message(body: bytes) -> ClientMessageUnion:
    """Decode and validate one client message; ProtocolError says exactly what is wrong."""
    try:
        return _client_decoder.decode(body)
    except RecursionError:
        raise ProtocolError(ErrorCode.MALFORMED, "invalid message: nested too deeply") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "Invalid value" in text and "$.type" in text:
            kind = _peek_type(body)
            if kind is not None and kind not in _KNOWN_CLIENT_TYPES:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_MESSAGE,
                    f"unknown message type {_quoted(kind)}; "
                    f"known: {', '.join(sorted(_KNOWN_CLIENT_TYPES))}",
                ) from None
        if len(text) > 300:
            text = text[:300] + "..."
        raise ProtocolError(ErrorCode.MALFORMED, f"invalid message: {text}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"not a JSON message: {exc}") from None


class _Peek(msgspec.Struct):
    """The two fields an error reply needs from a message that did not decode."""

    type: object = None
    seq: object = None


_peek_decoder = msgspec.json.Decoder(_Peek)


def _peek(body: bytes) -> _Peek | None:
    # Typed, so the rest of the body is skipped, not built: deep nesting costs nothing.
    try:
        return _peek_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def _peek_type(body: bytes) -> str | None:
    raw = _peek(body)
    return raw.type if raw is not None and isinstance(raw.type, str) else None


def peek_seq(body: bytes) -> int:
    """The ``seq`` of a client message that did not decode (0 if none), so the error answers it."""
    raw = _peek(body)
    seq = raw.seq if raw is not None else None
    if isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq <= (1 << 53):
        return seq
    return 0


def decode_broker_message(body: bytes) -> BrokerMessageUnion:
    try:
        return _broker_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"invalid broker message: {exc}") from None


class FrameReader:
    """Splits a byte stream into frames (sans-I/O: feed bytes, take bodies)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_body(self) -> bytes | None:
        """Next complete frame body, or None until more bytes arrive; ProtocolError if oversized."""
        if len(self._buffer) < _LENGTH.size:
            return None
        length = frame_length(bytes(self._buffer[: _LENGTH.size]))
        end = _LENGTH.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[_LENGTH.size : end])
        del self._buffer[:end]
        return body

    @property
    def pending(self) -> int:
        return len(self._buffer)


def snapshot_to_builtins(snapshot: Snapshot) -> dict:
    """The snapshot as plain JSON-ready data (``gpushare status --json``, the REST API)."""
    return msgspec.to_builtins(snapshot)


def encode_json(value: object) -> bytes:
    return _encoder.encode(value)
