"""A launch is classified once: the decision its caller passes is the one it runs by.

Without a GPU: the driver calls are stand-ins, and the launch runs unmodified (mode
``off``), which is the shortest way through ``launch_kernel``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import gpushare_ext.kernels.driver as driver
import gpushare_ext.kernels.launch as launch
from gpushare_ext.kernels.arguments import BoundArgs
from gpushare_ext.kernels.launch import LaunchDecision, LaunchMode, decide_launch, launch_kernel
from gpushare_ext.kernels.report import Classification, Idempotence

BOUND = BoundArgs([b"\0" * 8], {"p": (0x9000, 64)}, {})
KERNEL = SimpleNamespace(
    entry=SimpleNamespace(name="k"), ptx="", report=SimpleNamespace(), last_launch=None
)


@pytest.fixture
def classified(monkeypatch):
    """Count the classifications; every launch runs on stand-in driver calls."""
    calls: list[dict] = []

    def classify(report, extents):
        calls.append(extents)
        return Classification(Idempotence.NON_IDEMPOTENT, ("writes p",))

    monkeypatch.setattr(launch, "classify_launch", classify)
    monkeypatch.setattr(driver, "stream_handle", lambda stream: 0)
    monkeypatch.setattr(driver, "ensure_context", lambda device=None: None)
    monkeypatch.setattr(driver, "launch_raw", lambda *args, **kw: None)
    monkeypatch.setattr(driver, "modules", SimpleNamespace(function=lambda *args: "fn"))
    return calls


def test_a_decision_given_is_not_made_again(classified):
    decision = LaunchDecision(Classification(Idempotence.IDEMPOTENT, ()), LaunchMode.OFF)
    report = launch_kernel(KERNEL, 4, 32, (), bound=BOUND, decision=decision, sync=False)
    assert classified == []
    assert report.mode is LaunchMode.OFF
    assert report.classification is decision.classification


def test_without_a_decision_the_launch_is_classified_once(classified):
    report = launch_kernel(KERNEL, 4, 32, (), bound=BOUND, mode="off", sync=False)
    assert classified == [BOUND.extents]
    assert report.classification.verdict is Idempotence.NON_IDEMPOTENT


def test_restart_is_refused_for_a_kernel_that_is_not_idempotent(classified):
    with pytest.raises(launch.KernelError, match="restart mode needs an idempotent kernel"):
        decide_launch(KERNEL, BOUND.extents, "restart")
    assert decide_launch(KERNEL, BOUND.extents).mode is LaunchMode.SNAPSHOT
    assert decide_launch(KERNEL, BOUND.extents, "restart", preemptible=False).mode is (
        LaunchMode.OFF
    )
