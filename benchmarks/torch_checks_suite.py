"""Mixed precision, CUDA graphs and attention kernels through PyTorch's public API, as
pytest tests for the peer-suite harness (``benchmarks/peer_suites.py``).

pytorch/examples (``torch_examples_suite.py``) trains with autograd, SGD, Adam, cuDNN
RNNs and ``nn.TransformerEncoder``, but none of its examples uses automatic mixed
precision or CUDA graphs, and its Transformer takes one attention kernel.  These checks
fill that in, each as PyTorch's documentation writes it:

* a small convolutional network trained 30 steps under ``torch.autocast`` with a
  ``GradScaler`` (half-precision activations, fp32 loss, loss going down);
* a whole training step captured into a CUDA graph (warm-up on a side stream, capture,
  replay with new inputs copied into the static tensors), against the same steps run
  eagerly from the same weights: the same losses and weights;
* ``scaled_dot_product_attention`` forced onto each backend (flash, memory-efficient,
  cuDNN, math) against a float32 math reference, forward and backward.

Each test writes ``digest <name> <sha256>`` lines of its results beside the harness's log
(``<log>-printed/<test>.txt``), so that the four ways can be compared bit for bit.  It
must not depend on gpushare: the same file runs in a plain process.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterable
from typing import Any

import pytest

from benchmarks.torch_examples_suite import printed_folder

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def digest(tensors: Iterable[Any]) -> str:
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return sha.hexdigest()[:16]


def record(request: pytest.FixtureRequest, lines: list[str]) -> None:
    keep = printed_folder(request.config)
    if keep is not None:
        name = request.node.name.replace("/", "_")
        (keep / f"{name}.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def deterministic_cudnn():
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def test_mixed_precision_training_with_a_grad_scaler(request, deterministic_cudnn):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda()  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    generator = torch.Generator(device="cuda").manual_seed(1)
    images = torch.randn(256, 3, 32, 32, device="cuda", generator=generator)
    labels = torch.randint(0, 10, (256,), device="cuda", generator=generator)
    losses = []
    for _ in range(30):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        assert logits.dtype == torch.float16
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses)
    assert losses[-1] < losses[0], losses
    record(request, [f"digest weights {digest(model.parameters())}",
                     f"digest losses {digest([torch.tensor(losses)])}"])  # fmt: skip


def _training_step(model: Any, optimizer: Any, inputs: Any, labels: Any) -> Any:
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


def test_a_training_step_captured_in_a_cuda_graph_replays_as_it_runs_eagerly(request):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    static_inputs = torch.randn(128, 512, device="cuda")
    static_labels = torch.randint(0, 10, (128,), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the default stream, as capture needs
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            _training_step(model, optimizer, static_inputs, static_labels)
    torch.cuda.current_stream().wait_stream(side)

    eager = copy.deepcopy(model)  # the same weights the graph starts from
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _training_step(model, optimizer, static_inputs, static_labels)

    generator = torch.Generator(device="cuda").manual_seed(2)
    replayed, eager_losses = [], []
    for _ in range(20):
        inputs = torch.randn(128, 512, device="cuda", generator=generator)
        labels = torch.randint(0, 10, (128,), device="cuda", generator=generator)
        static_inputs.copy_(inputs)
        static_labels.copy_(labels)
        graph.replay()
        replayed.append(static_loss.item())
        eager_optimizer.zero_grad(set_to_none=True)
        eager_losses.append(_training_step(eager, eager_optimizer, inputs, labels).item())
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(eager_losses))
    for captured, plain in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(captured, plain)
    record(request, [f"digest weights {digest(model.parameters())}",
                     f"digest losses {digest([torch.tensor(replayed)])}"])  # fmt: skip


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                     "CUDNN_ATTENTION", "MATH"])  # fmt: skip
def test_scaled_dot_product_attention_on_each_backend_matches_the_math_reference(
    backend: str, request
):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(4, 8, 512, 64, device="cuda", dtype=torch.float16, requires_grad=True)
        for _ in range(3)
    )
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.float().square().mean().backward()
    except RuntimeError as exc:
        if "No available kernel" in str(exc):
            pytest.skip(f"{backend} has no kernel for these inputs on this GPU")
        raise
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    record(request, [f"digest output {digest([out])}",
                     f"digest gradients {digest([q.grad, k.grad, v.grad])}"])  # fmt: skip
