"""The example notebooks run top to bottom in a real kernel, as a user opens them."""

from __future__ import annotations

import re
import shutil

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from runtime_helpers import EXAMPLES, KERNEL_START_S, short_tempdir


def _outputs(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(str(output["data"].get("text/plain", "")))
    return "\n".join(parts)


def _execute(notebook) -> None:
    ipc_dir = short_tempdir("gps-ex-")
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=str(ipc_dir / "k"))
    try:
        NotebookClient(
            notebook, km=manager, timeout=120, allow_errors=False, startup_timeout=KERNEL_START_S
        ).execute()
    finally:
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_getting_started_runs_top_to_bottom_against_the_broker(on_broker):
    notebook = nbformat.read(EXAMPLES / "01-getting-started.ipynb", as_version=4)
    _execute(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    texts = [_outputs(cell) for cell in code]

    assert "gpushare defaults: priority=normal mem=4.0 GiB" in texts[1]
    assert "1073741824.0" in texts[2]  # ones(1024, 1024) @ itself, summed
    # The loop with safe points ran to the end; its cell's receipt comes after.
    *printed, receipt = texts[3].strip().splitlines()
    assert printed[-1].endswith("190") and receipt.startswith("gpushare: cell done: "), texts[3]
    assert "OccupancyWidget" in texts[4] or "GPU 0" in texts[4]  # %gpu status
    assert "no lease was held" in texts[5]  # every cell released its lease
    assert not on_broker.leases()


def test_the_contention_examples_print_what_a_reader_wants(on_broker):
    """As saved (no results cell added), each prints one or two sentences, not raw
    timestamps: a summary of the steps and the checksum, the products' timings."""
    training = nbformat.read(EXAMPLES / "training_low.ipynb", as_version=4)
    interactive = nbformat.read(EXAMPLES / "interactive_high.ipynb", as_version=4)
    for notebook in (training, interactive):
        assert notebook.cells[0].cell_type == "markdown"
        assert sum(c.cell_type == "markdown" for c in notebook.cells) >= 2

    _execute(training)
    _execute(interactive)

    shown = [line for line in _outputs(training.cells[-1]).splitlines() if line.strip()]
    # The example's own sentence, and the cell's receipt from gpushare.
    receipts = [line for line in shown if line.startswith("gpushare: cell done: ")]
    assert len(receipts) == 1, shown
    low = [line for line in shown if line not in receipts]
    assert len(low) == 1 and re.fullmatch(
        r"40 steps in \d+\.\d s; result checksum [0-9a-f]{16}", low[0]
    )
    *high, receipt = [line for line in _outputs(interactive.cells[-1]).splitlines() if line]
    assert re.fullmatch(r"5 products: median \d+\.\d ms, slowest \d+\.\d ms", high[-1]), high
    assert receipt.startswith("gpushare: cell done: "), receipt  # the cell's last line
    assert not on_broker.leases()
