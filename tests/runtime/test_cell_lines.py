"""The receipt a ``%%gpu`` cell shows when it ends (``runtime/cell_lines.py``)."""

from __future__ import annotations

from gpushare_ext.protocol import PreemptionLevel
from gpushare_ext.runtime.cell_lines import (
    PauseRecord,
    kernel_words,
    long_kernels_summary,
    receipt_line,
)


def test_a_cell_granted_at_once_and_never_paused_says_so():
    assert receipt_line(queued_s=0.04, ran_s=3.16, pauses=[]) == (
        "gpushare: cell done: ran 3.2 s; never paused"
    )
    assert receipt_line(queued_s=1.26, ran_s=3.16, pauses=[]) == (
        "gpushare: cell done: queued 1.3 s, ran 3.2 s; never paused"
    )


def test_each_pause_says_for_whom_at_which_rung_and_how_long():
    pauses = [
        PauseRecord("alice", PreemptionLevel.GATE, 1.24),
        PauseRecord("bob", PreemptionLevel.LOCK, 2.0),
    ]
    assert receipt_line(queued_s=2.0, ran_s=12.2, pauses=pauses) == (
        "gpushare: cell done: queued 2.0 s, ran 12.2 s; paused 2 times, 3.2 s in all "
        "(1.2 s for alice (gate), 2.0 s for bob (lock))"
    )


def test_past_three_pauses_the_rest_are_counted():
    pauses = [PauseRecord(f"u{n}", PreemptionLevel.YIELD, 1.0) for n in range(5)]
    pauses.append(PauseRecord("u5", PreemptionLevel.EVICT))  # still paused at the end
    line = receipt_line(queued_s=0.0, ran_s=9.0, pauses=pauses)
    assert line.startswith("gpushare: cell done: ran 9.0 s; paused 6 times"), line
    assert line.endswith(
        "paused 6 times, 5.0 s in all (1.0 s for u0 (yield), 1.0 s for u1 (yield), "
        "1.0 s for u2 (yield), 3 more, 2.0 s)"
    ), line
    assert "\n" not in line


def test_what_the_long_kernels_got_over_the_cell():
    before = {"preemptible": 2, "yields": 1, "aborts": 0, "saves": 0, "unmodified": 0,
              "unrivalled": 5}  # fmt: skip
    after = {"preemptible": 6, "yields": 4, "aborts": 1, "saves": 0, "unmodified": 1,
             "unrivalled": 5}  # fmt: skip
    assert kernel_words(before, after) == ("4 launches ready to stop (4 stops), 1 run unmodified")
    assert kernel_words(after, after) == ""
    line = receipt_line(queued_s=0, ran_s=1, pauses=[], kernels=kernel_words(before, after))
    assert line.endswith("; never paused; long kernels: 4 launches ready to stop (4 stops), "
                         "1 run unmodified")  # fmt: skip


def test_the_receipt_says_what_the_cells_long_kernels_cost_against_their_originals():
    before = {"preemptible": 2, "yields": 1, "preemptible_ns": 9_000_000,
              "original_ns": 3_000_000}  # fmt: skip
    after = {"preemptible": 5, "yields": 3, "preemptible_ns": 11_060_000,
             "original_ns": 5_000_000}  # fmt: skip
    # Over the cell: 2.06 ms of GPU time against 2 ms, not the process's 3.0 x so far.
    assert kernel_words(before, after) == (
        "3 launches ready to stop (2 stops), their GPU time 1.03 x their unmodified runs"
    )
    # Launches whose originals were never timed say nothing of a cost.
    untimed = {**after, "preemptible": 6, "preemptible_ns": 12_000_000}
    assert kernel_words(after, untimed) == "1 launches ready to stop"


def test_the_pause_notice_says_what_the_long_kernels_cost_once_one_was_timed():
    counted = {"preemptible": 4, "yields": 2, "saves": 12, "preemptible_ns": 10_100_000,
               "original_ns": 10_000_000}  # fmt: skip
    assert long_kernels_summary(counted) == (
        "4 long kernel launches preemptible, their GPU time 1.01 x their unmodified runs, "
        "2 yields, 12 stops that kept their work"
    )
    untimed = {**counted, "preemptible_ns": 0, "original_ns": 0}
    assert long_kernels_summary(untimed) == (
        "4 long kernel launches preemptible, 2 yields, 12 stops that kept their work"
    )


def test_a_receipt_says_how_long_making_the_cells_kernels_preemptible_took():
    before = {"preemptible": 0, "made_preemptible": 1, "preparation_ns": 9_000_000}
    after = {"preemptible": 2, "made_preemptible": 3, "preparation_ns": 70_400_000}
    assert kernel_words(before, after) == (
        "2 launches ready to stop, 2 kernels made preemptible in 61 ms"
    )
    one = {**after, "made_preemptible": 2, "preparation_ns": 40_000_000}
    assert kernel_words(before, one).endswith("1 kernel made preemptible in 31 ms")
    assert long_kernels_summary(after) == (
        "2 long kernel launches preemptible, 3 kernels made preemptible in 70 ms"
    )
