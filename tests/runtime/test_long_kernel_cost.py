"""What a session's long kernels cost it: the registry adds up the GPU time of the
launches it ran preemptibly beside the time the shim measured for their originals, and
``counts()`` gives both to the pause notice, status and a cell's receipt (no GPU here:
the launch's report is a stand-in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from gpushare_ext.runtime import interpose, preemptible

DIMS = (4, 1, 1, 128, 1, 1)


@dataclass
class Launches:
    """The process's registry, with one tracked function (7) whose launches return the
    next of ``reports`` and whose original the shim timed at ``longest_us``."""

    registry: preemptible.Registry
    reports: list[SimpleNamespace] = field(default_factory=list)
    longest_us: float = 0.0

    def launch(self) -> None:
        self.registry.on_launch(7, DIMS, 0, 0, None)


@pytest.fixture
def launches(monkeypatch) -> Launches:
    registry = preemptible.Registry()
    registry.twins[7] = preemptible.Twin(name="long_ew", module=1, kernel=object())
    fake = Launches(registry)
    monkeypatch.setattr(preemptible, "_registry", registry)
    monkeypatch.setattr(interpose, "answer_launch", lambda answer: None)
    monkeypatch.setattr(interpose, "function_state", lambda function: (2, fake.longest_us))
    monkeypatch.setattr(preemptible, "run_launch", lambda *args, **kwargs: fake.reports.pop(0))
    return fake


def _report(gpu_ns: int, interrupted: str = "") -> SimpleNamespace:
    return SimpleNamespace(gpu_ns=gpu_ns, yields=1, aborts=0, saves=0, interrupted=interrupted)


def test_each_launch_adds_its_gpu_time_beside_its_original(launches: Launches):
    launches.longest_us = 2_500.0
    launches.reports = [_report(2_600_000), _report(2_550_000)]
    launches.launch()
    launches.launch()
    assert launches.registry.launched == 2
    counted = preemptible.counts()
    assert counted["preemptible_ns"] == 5_150_000
    assert counted["original_ns"] == 5_000_000
    assert preemptible.summary() == (
        "2 long kernel launches preemptible, their GPU time 1.03 x their unmodified runs, "
        "1 kernel made preemptible in 0 ms, 2 yields"
    )


def test_making_a_kernel_preemptible_is_timed_once_and_counted():
    """A real CuPy kernel's PTX through the real analysis and transform (no GPU: the
    transformed module is loaded at its first launch, which adds the driver's time)."""
    from pathlib import Path

    ptx = (Path(__file__).parents[1] / "kernels" / "fixtures" / "cupy" / "loopy.ptx").read_bytes()
    name = next(
        line.split()[2].split("(")[0] for line in ptx.decode().splitlines()
        if line.startswith(".visible .entry")
    )  # fmt: skip
    twin = preemptible.Twin(name=name, module=1, ptx=ptx)
    twin.analyse()
    assert twin.kernel is not None, twin.reason
    first = twin.analysis_ns
    assert first > 0
    twin.analyse()  # once: nothing more
    assert twin.analysis_ns == first
    registry = preemptible.Registry()
    registry.twins[7] = twin
    registry.twins[8] = preemptible.Twin(name="short", module=1, ptx=b"x")  # never analysed
    original = preemptible._registry
    preemptible._registry = registry
    try:
        counted = preemptible.counts()
    finally:
        preemptible._registry = original
    assert counted["made_preemptible"] == 1
    assert counted["preparation_ns"] >= first


def test_launches_without_a_whole_measure_on_both_sides_are_not_counted(launches: Launches):
    launches.reports = [_report(2_600_000)]
    launches.launch()  # the shim never timed the original
    launches.longest_us = 2_500.0
    launches.reports = [_report(0), _report(900_000, interrupted="rolled back")]
    launches.launch()  # no slice left both stamps
    launches.launch()  # a Ctrl-C rolled it back: not the whole kernel
    registry = launches.registry
    assert registry.launched == 3 and registry.interrupted == 1
    assert (registry.preemptible_ns, registry.original_ns) == (0, 0)
    assert "GPU time" not in preemptible.summary()


def test_a_launch_ctrl_c_let_finish_is_counted(launches: Launches):
    launches.longest_us = 1_000.0
    launches.reports = [_report(1_200_000, interrupted="finished")]
    launches.launch()
    registry = launches.registry
    assert (registry.preemptible_ns, registry.original_ns) == (1_200_000, 1_000_000)
