"""The session's control block: a page of shared memory the broker writes and the runtime reads.

The broker creates one file per session (owned by the session's uid, mode 0600) and
writes into it; the runtime maps it.  Layout (little-endian uint32 words):

====== ============================================================
offset word
====== ============================================================
0      magic ``GPSH``
4      layout version
8      gate: 0 open, 1 closed (level 0)
12     state: the lease's state, ``lease_state.CONTROL_BLOCK_CODES`` (0: no lease)
16     generation: bumped on every broker write
20     preemption level in force (or 0xffffffff)
24     imports: times the process opened another process's GPU memory, written
       by the runtime's launch shim, read by the broker before it parks the session
28     unrivalled: 1 while no session that could preempt this one exists
32     park request: bumped by the broker for each request to the shim's park service
36     park answered: the request the service carried out last
40     park operation: 1 park, 2 restore
44     MiB to park (0: all), 48 host budget for it in MiB (0: none)
52     MiB the request moved, 56 its answer (0: all that was asked)
60     parkable MiB resident now, kept by the shim
64     reason text, UTF-8, NUL-padded to 192 bytes
512    session note, UTF-8, NUL-padded to 256 bytes: written by the *runtime*
       (what its long kernels got), read by the broker for status
====== ============================================================

On a GPU the runtime registers this page with ``cuMemHostRegister`` and enqueues
``cuStreamWaitValue32(gate == 0)`` on its session stream, so a closed gate holds new
launches in the device's queue without using SMs.  Without a GPU the runtime's launch
points wait on the gate word on the host (:meth:`ControlBlock.wait_open`).

This module must stay free of CUDA imports: the broker uses it too.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time
from pathlib import Path

from gpushare_ext.errors import GpushareError
from gpushare_ext.lease_state import (
    CONTROL_BLOCK_CODES,
    STOPPED,
    LeaseState,
    from_control_block_code,
)
from gpushare_ext.plain_text import plain_text

MAGIC = 0x48535047  # b"GPSH" little-endian
LAYOUT_VERSION = 1
SIZE = 4096
GATE_OFFSET = 8
STATE_OFFSET = 12
GENERATION_OFFSET = 16
LEVEL_OFFSET = 20
IPC_IMPORTS_OFFSET = 24
UNRIVALLED_OFFSET = 28
PARK_REQUEST_OFFSET = 32  # the words of the shim's park service (parkable_memory.c)
PARK_ANSWERED_OFFSET = 36
PARK_OPERATION_OFFSET = 40
PARK_WANT_MIB_OFFSET = 44
PARK_HOST_MIB_OFFSET = 48
PARK_MOVED_MIB_OFFSET = 52
PARK_ANSWER_OFFSET = 56
PARKABLE_RESIDENT_MIB_OFFSET = 60
PARK, RESTORE = 1, 2
MIB = 1 << 20
REASON_OFFSET = 64
REASON_SIZE = 192
SESSION_NOTE_OFFSET = 512
SESSION_NOTE_SIZE = 256
NO_LEVEL = 0xFFFFFFFF
_WORD = struct.Struct("<I")


def _futex_wake(address: int) -> None:
    """Wake whoever waits on the word at ``address`` (the shim's park service), in
    whichever process maps it; without futexes the service finds the word within a
    second anyway."""
    import ctypes
    import platform

    number = _FUTEX_SYSCALL.get(platform.machine())
    if number is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address), 1, 64, None, None, 0)
    except (OSError, AttributeError):
        pass


_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}  # SYS_futex; FUTEX_WAKE is 1


class ControlBlockError(GpushareError):
    """The control block is missing, not ours, or not a control block."""


class ControlBlock:
    """A mapped control block.  ``create`` is the broker's side, ``open`` the runtime's."""

    def __init__(self, path: Path, mapping: mmap.mmap, fd: int) -> None:
        self.path = path
        self._map = mapping
        self._fd = fd
        self.closed = False

    @classmethod
    def create(
        cls, path: str | Path, owner_uid: int | None = None, owner_gid: int | None = None
    ) -> ControlBlock:
        path = Path(path)
        # O_EXCL: a fresh name in the broker's own directory; whatever is there is not ours.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            if owner_uid is not None and os.geteuid() == 0:
                os.fchown(fd, owner_uid, owner_gid if owner_gid is not None else -1)
            os.ftruncate(fd, SIZE)
            mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        block = cls(path, mapping, fd)
        block._write(0, MAGIC)
        block._write(4, LAYOUT_VERSION)
        block._write(LEVEL_OFFSET, NO_LEVEL)
        return block

    @classmethod
    def open(cls, path: str | Path) -> ControlBlock:
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except PermissionError as exc:
            raise ControlBlockError(f"control block {path} is not yours: {exc.strerror}") from None
        except OSError as exc:
            raise ControlBlockError(f"cannot open control block {path}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            # Only a block the broker made for us: a file someone else owns, or one others
            # can write, could pause this session or read its state.
            if not stat.S_ISREG(info.st_mode):
                raise ControlBlockError(f"{path} is not a control block (not a regular file)")
            if info.st_uid != os.getuid():
                raise ControlBlockError(
                    f"control block {path} belongs to uid {info.st_uid}, not to you"
                )
            if stat.S_IMODE(info.st_mode) & 0o077:
                raise ControlBlockError(
                    f"control block {path} is open to other users "
                    f"(mode {stat.S_IMODE(info.st_mode):04o})"
                )
            if info.st_size < SIZE:
                raise ControlBlockError(f"{path} is not a control block (too small)")
            mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        block = cls(path, mapping, fd)
        if block._read(0) != MAGIC:
            block.close()
            raise ControlBlockError(f"{path} is not a control block (bad magic)")
        return block

    def close(self) -> None:
        """Unmap; later writes are ignored and reads say open and idle.  Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._map.close()
        finally:
            os.close(self._fd)

    # ---- words

    def _read(self, offset: int) -> int:
        if self.closed:
            return 0  # gate open, state idle: a closed block holds nobody
        return _WORD.unpack_from(self._map, offset)[0]

    def _write(self, offset: int, value: int) -> None:
        if not self.closed:
            _WORD.pack_into(self._map, offset, value)

    @property
    def gate_closed(self) -> bool:
        return self._read(GATE_OFFSET) != 0

    @property
    def state(self) -> LeaseState | None:
        """The state the broker published; None while the session holds no lease."""
        return from_control_block_code(self._read(STATE_OFFSET))

    @property
    def generation(self) -> int:
        return self._read(GENERATION_OFFSET)

    @property
    def level(self) -> int | None:
        value = self._read(LEVEL_OFFSET)
        return None if value == NO_LEVEL else value

    @property
    def ipc_imports(self) -> int:
        """How many times the session's process opened another process's GPU memory,
        as its launch shim counted (0 also when no shim counts)."""
        return self._read(IPC_IMPORTS_OFFSET)

    @property
    def reason(self) -> str:
        if self.closed:
            return ""
        raw = bytes(self._map[REASON_OFFSET : REASON_OFFSET + REASON_SIZE])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def publish(
        self,
        *,
        gate_closed: bool,
        state: LeaseState | None,
        level: int | None = None,
        reason: str = "",
    ) -> None:
        """Broker side: write gate, state, level and reason, then bump the generation.

        A block already closed (its session ended while an actuator was on its way) is
        left alone.
        """
        if self.closed:
            return
        encoded = reason.encode("utf-8")[: REASON_SIZE - 1]
        self._map[REASON_OFFSET : REASON_OFFSET + REASON_SIZE] = encoded.ljust(REASON_SIZE, b"\0")
        self._write(STATE_OFFSET, 0 if state is None else CONTROL_BLOCK_CODES[state])
        self._write(LEVEL_OFFSET, NO_LEVEL if level is None else int(level))
        self._write(GATE_OFFSET, 1 if gate_closed else 0)  # last: the gate is what waiters watch
        self._write(GENERATION_OFFSET, (self.generation + 1) & 0xFFFFFFFF)

    def publish_as(self, source: ControlBlock) -> None:
        """Write what ``source`` holds from the broker (gate, state, level, reason) into
        this block, for processes that map this one while the broker writes ``source``."""
        self.publish(
            gate_closed=source.gate_closed, state=source.state, level=source.level,
            reason=source.reason,
        )  # fmt: skip
        self.set_unrivalled(source.unrivalled)

    @property
    def unrivalled(self) -> bool:
        """No session that could preempt this one exists (as the broker last said)."""
        return self._read(UNRIVALLED_OFFSET) != 0

    def set_unrivalled(self, unrivalled: bool) -> None:
        """Broker side: whether the session's long kernels may run as they are."""
        self._write(UNRIVALLED_OFFSET, 1 if unrivalled else 0)

    def add_ipc_imports(self, count: int) -> None:
        """Runtime side: count imports made by processes that map another block of this
        session (the shim counts its own directly)."""
        if count > 0:
            self._write(IPC_IMPORTS_OFFSET, (self.ipc_imports + count) & 0xFFFFFFFF)

    # ---- the shim's park service (runtime/native/parkable_memory.c)

    @property
    def parkable_resident_bytes(self) -> int:
        """Device memory the session's shim could park now (0 also when it parks none)."""
        return self._read(PARKABLE_RESIDENT_MIB_OFFSET) * MIB

    def request_park(self, want_bytes: int, host_limit_bytes: int = 0) -> int:
        """Broker side: ask the shim to park ``want_bytes`` (0: all it can) within
        ``host_limit_bytes`` (0: no limit), rounded up to MiB; the request's number."""
        return self._request(PARK, -(-want_bytes // MIB), -(-host_limit_bytes // MIB))

    def request_restore(self) -> int:
        """Broker side: ask the shim to bring back all it parked; the request's number."""
        return self._request(RESTORE, 0, 0)

    def _request(self, operation: int, want_mib: int, host_mib: int) -> int:
        self._write(PARK_OPERATION_OFFSET, operation)
        self._write(PARK_WANT_MIB_OFFSET, min(want_mib, 0xFFFFFFFF))
        self._write(PARK_HOST_MIB_OFFSET, min(host_mib, 0xFFFFFFFF))
        request = (self._read(PARK_REQUEST_OFFSET) + 1) & 0xFFFFFFFF
        self._write(PARK_REQUEST_OFFSET, request)  # last: the service acts on this word
        if not self.closed:
            _futex_wake(self.address() + PARK_REQUEST_OFFSET)
        return request

    def park_answer(self, request: int) -> tuple[int, int] | None:
        """Broker side: (bytes moved, answer) once the shim carried out ``request`` (an
        answer of 0: all that was asked), None until then."""
        if self._read(PARK_ANSWERED_OFFSET) != request:
            return None
        return self._read(PARK_MOVED_MIB_OFFSET) * MIB, self._read(PARK_ANSWER_OFFSET)

    def write_session_note(self, text: str) -> None:
        """Runtime side: a line for the broker's status (what the session's long kernels
        got), cut to fit."""
        if self.closed:
            return
        encoded = text.encode("utf-8")[: SESSION_NOTE_SIZE - 1]
        end = SESSION_NOTE_OFFSET + SESSION_NOTE_SIZE
        self._map[SESSION_NOTE_OFFSET:end] = encoded.ljust(SESSION_NOTE_SIZE, b"\0")

    @property
    def session_note(self) -> str:
        """Broker side: the session's note as plain text (one line, every character shown
        as itself: :func:`~gpushare_ext.plain_text.plain_text`), or "".  The session
        writes it, so it is shown as the session's word, and an escape sequence or a line
        break in it shows as "␛" or "␤" in another user's status, never as one."""
        if self.closed:
            return ""
        raw = bytes(self._map[SESSION_NOTE_OFFSET : SESSION_NOTE_OFFSET + SESSION_NOTE_SIZE])
        return plain_text(raw.split(b"\0", 1)[0].decode("utf-8", "replace").strip())

    def address(self) -> int:
        """Host address of the mapping (for cuMemHostRegister); valid while open."""
        import ctypes

        buffer = (ctypes.c_char * SIZE).from_buffer(self._map)
        address = ctypes.addressof(buffer)
        del buffer
        return address

    def release_locally(self, reason: str) -> None:
        """Runtime side, when the broker is gone: open the gate and mark the session running
        (or idle, if it held no lease).

        Streams that wait on this page and loops in :meth:`wait_running` go on; the next
        broker starts from its journal, and nobody else may hold this session paused.
        """
        state = None if self.state is None else LeaseState.RUNNING
        self.publish(gate_closed=False, state=state, reason=reason)

    @property
    def paused(self) -> bool:
        return self.state in STOPPED

    def wait_running(self, timeout: float | None = None, poll_s: float = 0.001) -> bool:
        """Block while the broker holds the session paused or evicted.  False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.paused:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def wait_open(self, timeout: float | None = None, poll_s: float = 0.002) -> bool:
        """Host-side gate: block while the gate is closed.  False if ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.gate_closed:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True
