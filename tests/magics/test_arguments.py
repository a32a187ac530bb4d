"""``%%gpu`` / ``%gpuconfig`` arguments: both spellings parse alike; every bad value is one line
naming the argument (what the user reads above an unrun cell)."""

from __future__ import annotations

import pytest

from gpushare_ext.magics.arguments import ArgumentError, parse_duration, parse_lease_arguments
from gpushare_ext.protocol import PRIORITY_CLASSES, SliceWish
from gpushare_ext.runtime.session import LeaseOptions

GIB = 1024**3


def test_key_value_and_dash_dash_forms_mean_the_same():
    assert parse_lease_arguments("priority=high mem=8GiB timeout=30s") == parse_lease_arguments(
        "--priority high --mem 8GiB --timeout 30s"
    )
    assert parse_lease_arguments("--mem=512MiB") == {"memory_bytes": 512 * 1024**2}


def test_every_key_is_understood():
    options = parse_lease_arguments(
        "priority=high --mem 8GiB device=0 --timeout=2m slice=mig share=0.5 instrumented=yes"
    )
    assert options == {
        "priority": PRIORITY_CLASSES["high"],
        "memory_bytes": 8 * GIB,
        "device": "0",
        "timeout_s": 120.0,
        "slice": SliceWish.MIG,
        "sm_share": 0.5,
        "instrumented_only": True,
    }
    # and the result is what LeaseOptions takes
    LeaseOptions(**options)


def test_aliases_numbers_and_uuids():
    options = parse_lease_arguments(
        "prio=120 memory=1.5GiB wait=none sm_share=1 device=MIG-4f0c-aa"
    )
    assert options == {
        "priority": 120,
        "memory_bytes": int(1.5 * GIB),
        "timeout_s": None,
        "sm_share": 1.0,
        "device": "MIG-4f0c-aa",
    }


@pytest.mark.parametrize(
    "line", ["device=auto device=GPU-1234", "priority=high priority=low", "mem=1GiB --memory 2GiB"]
)
def test_a_key_given_twice_is_refused_naming_both_values(line):
    with pytest.raises(ArgumentError) as raised:
        parse_lease_arguments(line)
    message = str(raised.value)
    assert "is given twice" in message and "give it once" in message and "\n" not in message


def test_a_comment_after_the_arguments_is_a_comment_even_with_an_apostrophe():
    line = "priority=low mem=40GiB          # this notebook's defaults"
    assert parse_lease_arguments(line) == {"priority": 50, "memory_bytes": 40 * GIB}


def test_an_unclosed_quote_names_what_was_typed():
    with pytest.raises(ArgumentError) as raised:
        parse_lease_arguments("device='GPU-1")
    message = str(raised.value)
    assert message.startswith('cannot read "device=\'GPU-1": no closing quotation')


def test_an_empty_line_changes_nothing():
    assert parse_lease_arguments("") == {}
    assert parse_lease_arguments("   ") == {}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("1.5s", 1.5), ("250ms", 0.25), ("5m", 300.0), ("1h", 3600.0), ("7", 7.0),
     ("none", None), ("never", None), ("inf", None)],
)  # fmt: skip
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("priority=urgent", "priority"),
        ("priority=400", "priority"),
        ("priority=-3", "priority"),
        ("priority=", "priority"),
        ("mem=-1", "mem"),
        ("mem=8XB", "mem"),
        ("mem=0", "mem"),
        ("mem=lots", "mem"),
        ("device=gpu0", "device"),
        ("device=-1", "device"),
        ("timeout=soon", "timeout"),
        ("timeout=-5s", "timeout"),
        ("slice=half", "slice"),
        ("share=2", "share"),
        ("share=0", "share"),
        ("share=abc", "share"),
        ("share=nan", "share"),
        ("instrumented=maybe", "instrumented"),
        ("colour=red", "colour"),  # unknown key
        ("--mem", "--mem"),  # missing value
        ("--priority --mem 1GiB", "--priority"),  # missing value before the next key
        ("priority=high now", "now"),  # stray word
        ('priority="high', 'priority="high'),  # unbalanced quote: what was typed
    ],
)
def test_every_bad_argument_is_one_line_naming_it(line, named):
    with pytest.raises(ArgumentError) as caught:
        parse_lease_arguments(line)
    message = str(caught.value)
    assert "\n" not in message, message
    assert named in message, message


def test_bad_values_say_what_would_be_accepted():
    with pytest.raises(ArgumentError, match=r"priority.*low \| normal \| high \| 0-299"):
        parse_lease_arguments("priority=urgent")
    with pytest.raises(ArgumentError, match=r"unknown argument 'colour'; known: priority, mem"):
        parse_lease_arguments("colour=red")
    with pytest.raises(ArgumentError, match=r"unexpected argument 'now'; use key=value or --key"):
        parse_lease_arguments("priority=high now")


def test_a_bad_argument_is_reported_even_after_good_ones():
    with pytest.raises(ArgumentError, match="timeout"):
        parse_lease_arguments("priority=high mem=1GiB timeout=soon")


def test_the_key_tables_of_the_magics_help_line_up_and_gpuconfig_offers_no_ranks():
    import inspect

    from gpushare_ext.magics.arguments import KEYS
    from gpushare_ext.magics.gpu import GpuMagics

    for magic, keys in ((GpuMagics.gpu, set(KEYS)), (GpuMagics.gpuconfig, set(KEYS) - {"ranks"})):
        text = inspect.cleandoc(magic.__doc__)
        rows = [line for line in text.splitlines() if line.split(" ", 1)[0] in KEYS]
        assert {row.split(" ", 1)[0] for row in rows} == keys
        # Every description starts in the same column, right after the padded key.
        assert {len(row) - len(row[13:].lstrip()) for row in rows} == {14}, rows


@pytest.mark.parametrize(
    "value", ["99999999999999999999999GiB", "2PiB", "1025TiB", "9" * 400 + "GiB"]
)
def test_a_size_past_what_a_request_may_carry_names_mem_and_the_limit(value):
    """Not the broker's protocol text (``Expected int <= ... at $.memory_bytes``)."""
    with pytest.raises(ArgumentError) as caught:
        parse_lease_arguments(f"mem={value}")
    message = str(caught.value)
    assert message.startswith("bad value for mem: "), message
    assert "is more than 1.0 PiB, the most a request may ask for" in message, message
    assert "$." not in message and "\n" not in message and len(message) < 200, message


def test_the_largest_size_a_request_may_carry_is_the_wire_s_own_limit():
    from gpushare_ext.magics.arguments import MAX_MEMORY_BYTES
    from gpushare_ext.protocol import ProtocolError, RequestLease, decode_client_message
    from gpushare_ext.protocol import encode_frame as framed

    assert parse_lease_arguments("mem=1PiB") == {"memory_bytes": MAX_MEMORY_BYTES}
    # What is accepted here the broker's schema accepts, and one byte more it does not.
    for size, accepted in ((MAX_MEMORY_BYTES, True), (MAX_MEMORY_BYTES + 1, False)):
        body = framed(RequestLease(memory_bytes=size))[4:]
        try:
            decoded = decode_client_message(body)
        except ProtocolError:
            decoded = None
        assert (decoded is not None) == accepted, size


def test_digits_past_reason_are_refused_in_a_short_line():
    with pytest.raises(ArgumentError) as caught:
        parse_lease_arguments("mem=" + "9" * 5000)
    message = str(caught.value)
    assert message.startswith("bad value for mem: ") and len(message) < 200, message


def test_a_device_name_longer_than_the_wire_carries_is_refused_naming_device():
    with pytest.raises(ArgumentError) as caught:
        parse_lease_arguments("device=GPU-" + "f" * 300)
    message = str(caught.value)
    assert message.startswith("bad value for device: ") and len(message) < 200, message
