"""The README's notebook cells, as printed there, run in a real kernel of the default
install (no CuPy) on the simulated H200: a reader who copies them gets a result and the
cell's receipt, not a ``ModuleNotFoundError``."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_notebook_cells() -> list[str]:
    """The ``python`` blocks of the README's "In a notebook" section, in order."""
    text = README.read_text()
    section = text[text.index("## In a notebook\n") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readmes_notebook_cells_run_without_cupy_on_the_simulated_gpu(on_broker, kernels):
    (kernel,) = kernels(1)
    setup, gpu_cell = readme_notebook_cells()
    assert gpu_cell.startswith("%%gpu ")

    kernel.run(setup).ok()
    run = kernel.run(gpu_cell)

    assert run.status == "ok", run.describe()
    # The cell's value (the sum of a 4096 x 4096 product) and its receipt.
    assert re.search(r"^-?\d+\.\d+(e[+-]\d+)?$", run.final_text(), flags=re.M), run.describe()
    assert re.search(r"^gpushare: cell done: queued ", run.final_text(), flags=re.M), run.describe()
