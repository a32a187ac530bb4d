"""The stop-latency benchmark's arithmetic (CPU): the GPU clock's offset taken as a line
between two measurements, and each stop split into the host's raise, the GPU's first
sight of the flag, the drain and the time to a free GPU."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.preemptible import ClockOffset, _gpu_stops


def test_the_offset_is_interpolated_between_its_two_measurements():
    offset = ClockOffset((1_000_000_000, 500_000, 3_000), (3_000_000_000, 540_000, 4_000))
    assert offset.at(1_000_000_000) == 500_000
    assert offset.at(2_000_000_000) == 520_000
    assert offset.at(3_000_000_000) == 540_000
    assert offset.error_ns == 4_000
    assert offset.drift_us_per_s == 20.0


def test_a_stop_is_split_into_the_raise_the_sight_and_the_drain():
    offset = ClockOffset((0, 1_000, 500), (10_000_000_000, 1_000, 500))  # no drift
    preempter = SimpleNamespace(
        raised_ns=[1_000_000, 5_000_000],
        queued_ns=[1_004_000, 5_003_000],
        written_ns=[1_020_000, 5_021_000],
    )
    # GPU stamps = host + 1000 ns: a slice under way at the second raise, seen 40 us
    # after it and free 55 us after it; and one that began after the first raise.
    under_way = (4_000_000 + 1_000, 5_040_000 + 1_000, 5_055_000 + 1_000)
    began_flagged = (1_010_000 + 1_000, 1_011_000 + 1_000, 1_012_000 + 1_000)
    reports = [SimpleNamespace(stops_ns=[under_way, began_flagged])]
    found = _gpu_stops(reports, preempter, offset)
    assert found["free"] == [55.0]
    assert found["sight"] == [40.0]
    assert found["queued"] == [3.0]
    assert found["written"] == [21.0]
    assert found["drains"] == [15.0, 1.0]
    assert found["began_flagged"] == [2.0]
