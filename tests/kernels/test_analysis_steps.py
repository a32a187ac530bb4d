"""The analysis runs as named steps: a step that fails unexpectedly says which it was.

On the CPU, with a PTX kernel captured from CuPy (no compiler needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gpushare_ext.kernels.analysis as analysis
from gpushare_ext.kernels.analysis import AnalysisFailed, analyse_entry
from gpushare_ext.kernels.ptx import KernelError, parse_ptx

PTX = (Path(__file__).with_name("fixtures") / "cupy" / "rawk.ptx").read_text()


def test_a_step_that_breaks_is_named_with_the_kernel(monkeypatch):
    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(analysis, "compute_taint", broken)
    module = parse_ptx(PTX)
    with pytest.raises(AnalysisFailed) as caught:
        analyse_entry(module, module.entry("rawk"))
    error = caught.value
    assert isinstance(error, KernelError) and error.code == "analysis-failed"
    assert error.message == (
        "analysis of `rawk` failed at step 'taint': IndexError: list index out of range"
    )
    assert "\n" not in error.message
    assert error.failed_step == "taint"
    assert isinstance(error.__cause__, IndexError)


def test_a_kernel_error_raised_on_purpose_passes_as_it_is(monkeypatch):
    refusal = KernelError("bad-ptx", "a construct the analysis refuses", step="parse")

    def refuses(*args, **kwargs):
        raise refusal

    monkeypatch.setattr(analysis, "classify", refuses)
    module = parse_ptx(PTX)
    with pytest.raises(KernelError) as caught:
        analyse_entry(module, module.entry("rawk"))
    assert caught.value is refusal


def test_every_step_runs_by_name_when_nothing_breaks(monkeypatch):
    names: list[str] = []
    run = analysis._Steps.run

    def noting(self, name, step, *args, **kwargs):
        names.append(name)
        return run(self, name, step, *args, **kwargs)

    monkeypatch.setattr(analysis._Steps, "run", noting)
    module = parse_ptx(PTX)
    report = analyse_entry(module, module.entry("rawk"))
    assert report.classification.verdict.value == "idempotent"
    assert list(dict.fromkeys(names)) == [
        "control flow", "candidate pointers", "taint", "definite pointers", "memory accesses",
        "buffers", "barriers", "grid sync", "block-id uses", "early exits", "classification",
    ]  # fmt: skip
