"""pytorch/examples' own integration runs as pytest tests, for the peer-suite harness.

PyTorch's examples repository checks its examples with ``run_python_examples.sh``: each
example's script is run for one short epoch (``--dry-run`` where it has one) with the
flags that script gives, on CUDA with ``USE_CUDA=True``.  This module runs the examples
of that script that need no download, with the script's own flags, each as one test, so
that ``benchmarks/peer_suites.py`` can run them four ways (plain, unmarked, lease, chaos):

* ``dcgan``: ``main.py --dataset fake --accel --dry-run`` (a GAN on FakeData, Adam);
* ``imagenet``: ``main.py --epochs 1 sample/`` and ``... --gpu 0 sample/`` (ResNet-18,
  SGD, the DataLoader's worker processes); the script downloads one photo into
  ``sample/``, here a generated 500x375 JPEG stands in for it;
* ``word_language_model``: ``main.py --epochs 1 --dry-run --accel`` then ``generate.py
  --accel``, for the default LSTM and for ``RNN_TANH``, ``RNN_RELU``, ``LSTM``, ``GRU``
  and ``Transformer`` (cuDNN RNNs, ``nn.TransformerEncoder`` through scaled-dot-product
  attention, gradient clipping, ``torch.save``/``torch.load``).  A checkout without
  WikiText-2's ``train.txt`` (a shallow copy may leave out files of 4 MiB and more) gets
  one made of its ``valid.txt`` and ``test.txt``: the same words, a smaller epoch.

``GPUSHARE_TORCH_EXAMPLES`` names a checkout of pytorch/examples (it never ships with
gpushare).  Each test runs its example in a copy of the example's folder (the ways may
run at once) inside this process, as ``python main.py ...`` would (``__main__``, its
folder first on ``sys.path``, its own ``sys.argv``), and what the example printed is
kept beside the harness's log (``<log>-printed/<test>.txt``) so that the ways' losses
can be compared.  It must not change what an example does.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shutil
import sys
from pathlib import Path

import pytest

RNN_MODELS = ("RNN_TANH", "RNN_RELU", "LSTM", "GRU", "Transformer")

# (test name, example folder, the runs: script and its arguments, as the script gives them)
CASES: list[tuple[str, str, list[list[str]]]] = [
    ("dcgan", "dcgan", [["main.py", "--dataset", "fake", "--accel", "--dry-run"]]),
    ("imagenet", "imagenet", [["main.py", "--epochs", "1", "sample/"],
                              ["main.py", "--epochs", "1", "--gpu", "0", "sample/"]]),
    ("word_language_model-default", "word_language_model",
     [["main.py", "--epochs", "1", "--dry-run", "--accel"], ["generate.py", "--accel"]]),
    *[
        (f"word_language_model-{model}", "word_language_model",
         [["main.py", "--model", model, "--epochs", "1", "--dry-run", "--accel"],
          ["generate.py", "--accel"]])
        for model in RNN_MODELS
    ],
]  # fmt: skip


def examples_checkout() -> Path:
    where = os.environ.get("GPUSHARE_TORCH_EXAMPLES")
    if not where or not Path(where, "run_python_examples.sh").is_file():
        pytest.skip("GPUSHARE_TORCH_EXAMPLES does not name a pytorch/examples checkout")
    return Path(where)


def make_sample_images(folder: Path) -> None:
    """What the script downloads for the imagenet example: one photo, in train/n and val/n."""
    from PIL import Image

    pixels = bytes((i * 7 + (i // 1500) * 13) % 256 for i in range(500 * 375 * 3))
    image = Image.frombytes("RGB", (500, 375), pixels)
    for split in ("train", "val"):
        (folder / "sample" / split / "n").mkdir(parents=True, exist_ok=True)
        image.save(folder / "sample" / split / "n" / "photo.jpg", quality=90)


def make_training_text(folder: Path) -> None:
    corpus = folder / "data" / "wikitext-2"
    if not (corpus / "train.txt").exists():
        parts = [(corpus / name).read_text() for name in ("valid.txt", "test.txt")]
        (corpus / "train.txt").write_text("".join(parts))


def run_script(folder: Path, argv: list[str]) -> None:
    """``python <argv>`` in ``folder``, in this process; the folder's modules are forgotten
    afterwards so that the next example imports its own ``model`` or ``data``."""
    before_modules = set(sys.modules)
    saved = (os.getcwd(), list(sys.path), list(sys.argv))
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    sys.argv = list(argv)
    try:
        runpy.run_path(str(folder / argv[0]), run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise AssertionError(f"{' '.join(argv)} exited with {done.code}") from done
    finally:
        os.chdir(saved[0])
        sys.path[:], sys.argv[:] = saved[1], saved[2]
        for name in set(sys.modules) - before_modules:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if origin.startswith(str(folder)):
                del sys.modules[name]


def printed_folder(config: pytest.Config) -> Path | None:
    log = config.getoption("peer_log", default=None)
    if not log:
        return None
    folder = Path(log).with_name(Path(log).stem + "-printed")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.parametrize(("name", "example", "runs"), CASES, ids=[c[0] for c in CASES])
def test_example(
    name: str, example: str, runs: list[list[str]], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    folder = tmp_path / example
    shutil.copytree(examples_checkout() / example, folder)
    if example == "imagenet":
        make_sample_images(folder)
    if example == "word_language_model":
        make_training_text(folder)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            for argv in runs:
                print(f"$ python {' '.join(argv)}")
                run_script(folder, argv)
    finally:
        keep = printed_folder(request.config)
        if keep is not None:
            (keep / f"{name}.txt").write_text(printed.getvalue())
