"""Distributed training from a notebook, in real kernels on the module's broker (the
simulated H200, so the ranks train on the CPU with gloo): ``%%gpu ranks=N`` and
``gpushare_ext.launch`` take one gang lease, run every rank in its own process named to
the broker, show each rank's output, and leave nothing leased or running."""

from __future__ import annotations

from pathlib import Path

import psutil
from runtime_helpers import holding_cell, wait_for

GIB = 1024**3


def _started(kernels, count: int) -> list:
    started = kernels(count)
    for kernel in started:
        kernel.run("%load_ext gpushare_ext").ok()
    return started


def _gang_leases(broker) -> list:
    return [lease for lease in broker.leases() if "." in lease.lease_id]


def _waiting_cell(release: Path, ranks: int, extra: str = "") -> str:
    return (
        f"%%gpu ranks={ranks} mem=2GiB {extra}\n"
        "import os, time\n"
        "import torch.distributed as dist\n"
        "print('pid', os.getpid(), 'rank', dist.get_rank(), 'of', dist.get_world_size(), flush=True)\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.05)\n"
        "t = __import__('torch').tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(t)\n"
        "print('sum', t.item(), flush=True)\n"
    )


def _pids_shown(run, ranks: int) -> list[int]:
    text = wait_for(
        lambda: run.final_text() if run.final_text().count("[rank") >= ranks else None,
        "every rank to say its pid",
    )
    pids = {}
    for line in text.splitlines():
        if "] pid " in line:
            words = line.split()  # [rank 0] pid 1234 rank 0 of 2
            pids[int(words[5])] = int(words[3])
    return [pids[rank] for rank in sorted(pids)]


def test_a_cell_with_ranks_runs_in_worker_processes_under_one_gang_lease(
    on_broker, kernels, tmp_path
):
    (kernel,) = _started(kernels, 1)
    release = tmp_path / "go"
    run = kernel.submit(_waiting_cell(release, 2))

    pids = _pids_shown(run, 2)
    leases = wait_for(lambda: len(_gang_leases(on_broker)) == 2 and _gang_leases(on_broker),
                      "the gang's two leases")  # fmt: skip
    # Each rank's lease is held by the worker that runs it, not by the kernel.
    assert sorted(lease.pid for lease in leases) == sorted(pids)
    assert kernel.pid not in pids
    assert {lease.state.value for lease in leases} == {"running"}
    assert {lease.memory_bytes for lease in leases} == {2 * GIB}
    release.touch()
    run.ok()

    text = run.final_text()
    assert "gpushare: starting 2 ranks (gloo: every rank runs on the CPU" in text
    assert "[rank 0] sum 3.0" in text and "[rank 1] sum 3.0" in text
    wait_for(lambda: not on_broker.leases(), "the gang to be released")
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_a_high_cell_pauses_the_whole_gang_and_it_resumes(on_broker, kernels, tmp_path):
    trainer, explorer = _started(kernels, 2)
    release, high_done = tmp_path / "go", tmp_path / "high-done"
    run = trainer.submit(_waiting_cell(release, 2, "priority=low"))
    _pids_shown(run, 2)

    high = explorer.submit(holding_cell(high_done, priority="high"))
    wait_for(lambda: {lease.state.value for lease in _gang_leases(on_broker)} == {"paused"},
             "both ranks to be paused")  # fmt: skip
    run.wait_shown("paused for a higher-priority session")
    high_done.touch()
    high.ok()
    wait_for(lambda: {lease.state.value for lease in _gang_leases(on_broker)} == {"running"},
             "both ranks to resume")  # fmt: skip
    release.touch()
    run.ok()
    assert "resumed after" in run.shown_text()


def test_launch_runs_a_function_on_every_rank_and_returns_their_results(on_broker, kernels):
    (kernel,) = _started(kernels, 1)
    run = kernel.run(
        "import gpushare_ext, torch\n"
        "def mean_of_ranks(scale):\n"
        "    import torch.distributed as dist\n"
        "    t = torch.tensor([float(dist.get_rank())]) * scale\n"
        "    dist.all_reduce(t)\n"
        "    return t.item() / dist.get_world_size()\n"
        "print(gpushare_ext.launch(mean_of_ranks, 10.0, ranks=4, memory_bytes=1 << 30))\n"
    ).ok()

    assert "[15.0, 15.0, 15.0, 15.0]" in run.final_text()
    wait_for(lambda: not on_broker.leases(), "the gang to be released")


def test_bad_gang_requests_are_one_line_and_lease_nothing(on_broker, kernels):
    (kernel,) = _started(kernels, 1)

    too_big = kernel.run("%%gpu ranks=3 mem=100GiB\nprint('the body ran')\n")
    too_many = kernel.run("%%gpu ranks=9 mem=1GiB\nprint('the body ran')\n")
    zero = kernel.run("%%gpu ranks=0\nprint('the body ran')\n")
    config = kernel.run("%gpuconfig ranks=2\n")

    for run in (too_big, too_many, zero, config):
        assert run.status == "error" and "the body ran" not in run.final_text(), run.describe()
        assert len(run.stderr.strip().splitlines()) == 1, run.describe()
    assert (
        "3 ranks of 100 GiB can never run at once here: the matching devices and slices "
        "hold 1 at most" in too_big.stderr
    )
    assert (
        "a gang of 9 ranks takes 9 leases; you hold or wait for 0 and your policy "
        "allows 8" in too_many.stderr
    )
    assert "bad value for ranks: '0' is not a whole number from 1 to 64" in zero.stderr
    assert "ranks is a cell's own choice" in config.stderr
    assert not on_broker.leases()


def test_interrupting_a_gang_cell_stops_every_rank_and_releases_the_gang(
    on_broker, kernels, tmp_path
):
    (kernel,) = _started(kernels, 1)
    run = kernel.submit(_waiting_cell(tmp_path / "never", 2))
    pids = _pids_shown(run, 2)

    kernel.interrupt()
    run.wait()

    assert run.status == "error"
    assert "gpushare: stopped all 2 ranks" in run.final_text()
    wait_for(lambda: not on_broker.leases(), "the interrupted gang to be released")
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids), "the ranks to be gone")


def _gate_watching_cell(release: Path, seen: Path, block: str) -> str:
    """A low-priority gang whose ranks record what ``block`` says: the session's control
    block when the gang starts, which GPU ranks' launch shim holds launches on."""
    return (
        "%%gpu ranks=2 mem=2GiB priority=low\n"
        "import os, time\n"
        "import torch.distributed as dist\n"
        "from gpushare_ext.control_block import ControlBlock\n"
        f"block = ControlBlock.open({block!r})\n"
        f"mine = {str(seen)!r} + str(dist.get_rank())\n"
        "print('watching', flush=True)\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    state = block.state.value if block.state else 'none'\n"
        "    open(mine + '.tmp', 'w').write(f'{int(block.gate_closed)} {state}')\n"
        "    os.replace(mine + '.tmp', mine)\n"
        "    time.sleep(0.02)\n"
        "dist.barrier()\n"
    )


def _seen_by_ranks(seen: Path) -> set[str]:
    texts = set()
    for rank in (0, 1):
        try:
            texts.add(Path(f"{seen}{rank}").read_text())
        except OSError:
            texts.add("")
    return texts


def test_after_a_broker_restart_the_gate_still_reaches_a_running_gangs_workers(
    extra_broker, kernels, monkeypatch, tmp_path
):
    import signal

    broker = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    trainer, explorer = _started(kernels, 2)
    release, high_done, seen = tmp_path / "go", tmp_path / "high-done", tmp_path / "seen-"
    trainer.run("%%gpu\npass\n").ok()  # connects: the session has its control block
    block = (
        trainer.run(
            "import gpushare_ext\nprint(gpushare_ext.current_session().control_block.path)\n"
        )
        .ok()
        .final_text()
        .strip()
    )
    run = trainer.submit(_gate_watching_cell(release, seen, block))
    run.wait_shown("watching")
    wait_for(lambda: _seen_by_ranks(seen) == {"0 running"}, "both ranks to see the gang run")

    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL, broker.log_tail()
    broker.start()  # same socket, same journal: the kernel reclaims its gang
    wait_for(lambda: {lease.state.value for lease in _gang_leases(broker)} == {"running"},
             "the gang to be reclaimed by the new broker", 30)  # fmt: skip

    high = explorer.submit(holding_cell(high_done, priority="high"))
    wait_for(lambda: {lease.state.value for lease in _gang_leases(broker)} == {"paused"},
             "both ranks to be paused")  # fmt: skip
    # The new broker writes the session's new block; the workers map the old one.
    wait_for(lambda: _seen_by_ranks(seen) == {"1 paused"}, "the workers' gate to close")
    high_done.touch()
    high.ok()
    wait_for(lambda: _seen_by_ranks(seen) == {"0 running"}, "the workers' gate to open")
    release.touch()
    run.ok()
    wait_for(lambda: not broker.leases(), "the gang to be released")
