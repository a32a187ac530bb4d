"""Fuzzing the wire (hypothesis): the frame reader, every message type, and a live broker.

* However a stream of frames is cut into chunks, the reader gives back exactly the
  frames that were sent; arbitrary bytes raise nothing but ``ProtocolError``.
* A message of any type with any fields (wrong types, deep nesting, odd digits, huge
  strings, numbers out of range) decodes to a valid message or a ``ProtocolError``
  with a code and a short sentence: nothing else escapes.
* A live broker answers every such frame with one typed reply and keeps serving.

Bounded to well under a minute; ``benchmarks/fuzz_frames.py`` runs a million frames.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from broker_wire import RawClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import launch_broker

from gpushare_ext.protocol import (
    MAX_FRAME_BYTES,
    BrokerMessage,
    CellActivity,
    ClientMessage,
    ClientMessageUnion,
    Error,
    ErrorCode,
    FrameReader,
    ProtocolError,
    Welcome,
    decode_client_message,
)

MESSAGE_TYPES = sorted(
    cls.__struct_config__.tag
    for cls in ClientMessageUnion.__args__  # type: ignore[attr-defined]
)
FIELDS = sorted(
    {
        name
        for cls in ClientMessageUnion.__args__  # type: ignore[attr-defined]
        for name in cls.__struct_fields__
    }
    | {"type", "bogus"}
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["²", "①", "0", "7", "auto", "GPU-x", "MIG-", "high", "-1", "1e9", "0x10"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)


@st.composite
def messages(draw) -> dict:
    kind = draw(st.one_of(st.sampled_from(MESSAGE_TYPES), st.text(max_size=30)))
    fields = draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
    fields["type"] = kind
    if draw(st.booleans()):
        fields["seq"] = draw(st.integers(min_value=0, max_value=1000))
    return fields


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


bodies = st.one_of(
    messages().map(lambda m: json.dumps(m).encode()),
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=20_000).map(nested),
    st.integers(min_value=1, max_value=20_000).map(
        lambda depth: b'{"type":"status","seq":3,"x":' + nested(depth) + b"}"
    ),
)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=8), st.data())
def test_the_frame_reader_gives_back_what_was_sent_however_it_is_cut(bodies_sent, data):
    stream = b"".join(frame(body) for body in bodies_sent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    reader = FrameReader()
    received = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        reader.feed(stream[start:end])
        while (body := reader.next_body()) is not None:
            received.append(body)
    assert received == bodies_sent
    assert reader.pending == 0


@FUZZ
@given(st.binary(max_size=600))
def test_arbitrary_bytes_give_frames_or_a_protocol_error(raw):
    reader = FrameReader()
    reader.feed(raw)
    try:
        while (body := reader.next_body()) is not None:
            assert len(body) <= MAX_FRAME_BYTES
    except ProtocolError as exc:
        assert exc.code == ErrorCode.TOO_LARGE


@FUZZ
@given(bodies)
def test_any_body_decodes_to_a_message_or_a_typed_short_error(body):
    try:
        message = decode_client_message(body)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert 0 < len(exc.message) <= 2_000
        assert "\n" not in exc.message
    else:
        assert isinstance(message, ClientMessage)


@pytest.fixture(scope="module")
def fuzzed_broker():
    running = launch_broker()
    yield running
    running.stop()
    shutil.rmtree(running.directory, ignore_errors=True)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_a_live_broker_answers_every_frame_with_one_typed_reply(fuzzed_broker, body):
    try:
        unanswered = isinstance(decode_client_message(body), CellActivity)
    except ProtocolError:
        unanswered = False
    with RawClient(fuzzed_broker.socket) as raw:
        assert isinstance(raw.hello(), Welcome)
        raw.send_bytes(frame(body))
        if unanswered:  # the one message the broker does not answer: a cell must not wait
            assert raw.status().host
            return
        answer = raw.recv(timeout=10)
        assert isinstance(answer, BrokerMessage)
        if isinstance(answer, Error):
            assert len(answer.message) <= 1_000
        # And it still serves this connection (a hello in the fuzz may have been refused).
        assert raw.status().host
    assert fuzzed_broker.process.poll() is None
