"""The receipt a ``%%gpu`` cell shows when it ends (``runtime/cell_lines.py``)."""

from __future__ import annotations

from gpushare_ext.protocol import PreemptionLevel, Queued
from gpushare_ext.runtime.cell_lines import (
    PauseRecord,
    estimate_text,
    kernel_words,
    long_kernels_summary,
    queue_line,
    receipt_line,
)


def test_a_cell_never_paused_says_its_queue_time_even_when_it_is_zero():
    assert receipt_line(queued_s=0.04, held_s=3.16, pauses=[]) == (
        "gpushare: cell done: queued 0.0 s, ran 3.2 s, never paused"
    )
    assert receipt_line(queued_s=1.26, held_s=3.16, pauses=[]) == (
        "gpushare: cell done: queued 1.3 s, ran 3.2 s, never paused"
    )


def test_the_time_running_and_the_time_paused_are_told_apart():
    pauses = [
        PauseRecord("alice", PreemptionLevel.GATE, 1.24),
        PauseRecord("bob", PreemptionLevel.LOCK, 2.0),
    ]
    # 12.2 s from the grant to the end, 3.2 s of it paused: it ran 9.0 s.
    assert receipt_line(queued_s=2.0, held_s=12.2, pauses=pauses) == (
        "gpushare: cell done: queued 2.0 s, ran 9.0 s, paused 3.2 s (twice: "
        "1.2 s for alice (gate), 2.0 s for bob (lock))"
    )
    one = [PauseRecord("alice", PreemptionLevel.GATE, 1.5)]
    assert receipt_line(queued_s=0.0, held_s=4.0, pauses=one) == (
        "gpushare: cell done: queued 0.0 s, ran 2.5 s, paused 1.5 s for alice (gate)"
    )


def test_a_pause_still_open_at_the_end_counts_as_paused():
    pauses = [PauseRecord("bob", PreemptionLevel.EVICT)]
    line = receipt_line(queued_s=0.0, held_s=10.0, pauses=pauses, open_pause_s=4.0)
    assert line == (
        "gpushare: cell done: queued 0.0 s, ran 6.0 s, paused 4.0 s for bob (evict), until the end"
    )


def test_a_pause_the_broker_never_ended_has_no_length_and_takes_none_of_the_last_ones():
    # Paused, the broker restarted (the cell ran on), paused again and resumed after 3.1 s.
    pauses = [PauseRecord("bob", PreemptionLevel.GATE), PauseRecord("bob", PreemptionLevel.GATE)]
    pauses[1].seconds = 3.1
    line = receipt_line(queued_s=0.0, held_s=10.0, pauses=pauses, open_pause_s=3.1)
    assert line == (
        "gpushare: cell done: queued 0.0 s, ran 6.9 s, paused 3.1 s (twice: for bob (gate), "
        "length unknown, 3.1 s for bob (gate))"
    )


def test_four_pauses_are_all_named_and_past_that_the_rest_are_counted_as_pauses():
    four = [PauseRecord(f"u{n}", PreemptionLevel.YIELD, 1.0) for n in range(4)]
    line = receipt_line(queued_s=0.0, held_s=9.0, pauses=four)
    assert line.endswith(
        "ran 5.0 s, paused 4.0 s (4 times: 1.0 s for u0 (yield), 1.0 s for u1 (yield), "
        "1.0 s for u2 (yield), 1.0 s for u3 (yield))"
    ), line
    assert "more" not in line  # never "1 more": that one is named like the others
    six = [PauseRecord(f"u{n}", PreemptionLevel.YIELD, 1.0) for n in range(5)]
    six.append(PauseRecord("u5", PreemptionLevel.EVICT))  # still paused at the end
    line = receipt_line(queued_s=0.0, held_s=9.0, pauses=six, open_pause_s=0.5)
    assert line.endswith(
        "ran 3.5 s, paused 5.5 s (6 times: 1.0 s for u0 (yield), 1.0 s for u1 (yield), "
        "1.0 s for u2 (yield) and 3 more pauses of 2.5 s in all)"
    ), line
    assert "\n" not in line


def test_a_revoked_lease_gets_a_receipt_saying_how_long_the_cell_ran_without_it():
    line = receipt_line(
        queued_s=0.5, held_s=8.0, pauses=[], revoked="cancelled by an admin", unleased_s=5.2
    )
    assert line == (
        "gpushare: cell done: queued 0.5 s, ran 8.0 s, never paused; lease revoked "
        "(cancelled by an admin): the last 5.2 s ran without a lease"
    )


def test_what_the_long_kernels_got_over_the_cell():
    before = {"preemptible": 2, "yields": 1, "aborts": 0, "saves": 0, "unmodified": 0}
    after = {"preemptible": 6, "yields": 4, "aborts": 1, "saves": 0, "unmodified": 1}
    assert kernel_words(before, after) == ("4 launches ready to stop (4 stops), 1 run unmodified")
    assert kernel_words(after, after) == ""
    line = receipt_line(queued_s=0, held_s=1, pauses=[], kernels=kernel_words(before, after))
    assert line.endswith(", never paused; long kernels: 4 launches ready to stop (4 stops), "
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


def test_names_and_reasons_from_others_stay_one_line_of_plain_text():
    pauses = [PauseRecord("eve\x1b[2J\nroot", PreemptionLevel.GATE, 1.0)]
    line = receipt_line(
        queued_s=0.0, held_s=2.0, pauses=pauses, revoked="cancelled\nby \u202eadmin"
    )
    assert "\n" not in line and "\x1b" not in line and "\u202e" not in line, line
    assert "for eve␛[2J␤root (gate)" in line and "(cancelled␤by <U+202E>admin)" in line, line


def test_a_far_back_place_reads_as_the_bound_the_broker_told():
    # Past the exact places the broker tells a rounded place ("that place or nearer"),
    # so a cell must not claim it stands exactly there.
    from gpushare_ext.protocol import EXACT_PLACES, Queued, told_place
    from gpushare_ext.runtime import cell_lines

    far = told_place(EXACT_PLACES + 91)
    queued = Queued(lease_id="L9", position=far, waiting_for="ada", reason="memory")
    assert cell_lines.queue_line(queued, 3).startswith(f"queued: within the first {far}, ")
    assert "(still within the first 200)" in cell_lines.timed_out_words(5, 200)
    near = Queued(lease_id="L1", position=EXACT_PLACES, waiting_for="ada", reason="memory")
    assert cell_lines.queue_line(near, 3).startswith(f"queued: position {EXACT_PLACES}, ")
    assert "(still at position 3)" in cell_lines.timed_out_words(5, 3)


def test_a_wait_for_memory_freed_counts_down_at_the_measured_rate_and_the_receipt_names_it():
    freeing = Queued(
        lease_id="L2", position=1, waiting_for="alice", estimate_s=6.0,
        reason="freeing 61 GiB: parking idle sessions (their memory goes to the host)",
        freeing_bytes=61 * 1024**3,
    )  # fmt: skip
    words = estimate_text(freeing, since_notice_s=2.0, waited_s=2.0, timeout_s=None)
    assert words == ", about 4 s left to free 61.0 GiB at the measured rate"
    late = estimate_text(freeing, since_notice_s=9.0, waited_s=9.0, timeout_s=None)
    assert late == ", freeing 61.0 GiB is taking 3 s longer than its measured rate"
    assert "holder" not in late  # not a holder's habit: nobody holds that memory by choice
    line = queue_line(freeing, 2.0, words)
    assert "position 1" in line and "freeing 61 GiB: parking idle sessions" in line

    receipt = receipt_line(queued_s=7.3, held_s=3.0, pauses=[], freeing=(6.8, 61 * 1024**3))
    assert receipt == (
        "gpushare: cell done: queued 7.3 s (6.8 s of it freeing 61.0 GiB of GPU memory), "
        "ran 3.0 s, never paused"
    )
