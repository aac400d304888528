"""Few-row fp32 GEMM microbenchmarks (pytest-benchmark): ``narrow_gemm`` against torch.

    pytest bench/test_narrow_gemm_bench.py --benchmark-only --benchmark-json=results/gemm.json

One SmolLM2-135M MLP (``576 -> 1536 -> 576``, about 7 MB of fp32 weights) at ``M`` rows,
the shape of a verify forward of an ``M``-node tree at batch 1 in the local engine. The
kernel reads the weights once per block of up to 4 rows (``tree_dev/csrc/narrow_gemm.c``),
so the cost steps up past 4, 8, ... rows; the rows grid shows where. The weights fit this
CPU's caches; a whole model's (540 MB) stream from memory, so a kernel change is judged on
the model too (``docs/design_figures.md``). Each case is checked
against ``x @ W.T`` once (fp32, 1e-4: sums of 1536 products in another order). One torch
thread (a shared machine); skipped where the kernel cannot build (no AVX2 / compiler).
"""

from __future__ import annotations

import pytest
import torch

from tree_dev.narrow_linear import narrow_available, narrow_gemm, pack_weight

pytestmark = pytest.mark.skipif(not narrow_available(), reason="narrow_gemm needs x86 AVX2 + cc")
ROWS = [1, 2, 4, 5, 6, 8, 9, 16]
HIDDEN, INTER = 576, 1536  # SmolLM2-135M
torch.set_num_threads(1)


def _mlp(rows: int):
    gen = torch.Generator().manual_seed(rows)
    up, down = torch.randn(INTER, HIDDEN, generator=gen), torch.randn(HIDDEN, INTER, generator=gen)
    x, h = torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, INTER, generator=gen)
    return x, h, up, down


@pytest.mark.parametrize("rows", ROWS)
def test_narrow_gemm(benchmark, rows):
    x, h, up, down = _mlp(rows)
    pu, pd = pack_weight(up), pack_weight(down)
    torch.testing.assert_close(narrow_gemm(x, pu, INTER), x @ up.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(narrow_gemm(h, pd, HIDDEN), h @ down.T, rtol=1e-4, atol=1e-4)
    benchmark(lambda: (narrow_gemm(x, pu, INTER), narrow_gemm(h, pd, HIDDEN)))


@pytest.mark.parametrize("rows", ROWS)
def test_torch_matmul(benchmark, rows):
    x, h, up, down = _mlp(rows)
    benchmark(lambda: (x @ up.T, h @ down.T))


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M's decoder (fp32) with its linears on ``narrow_gemm``: the whole-model
    counterpart of the cases above (weights streamed from memory, not cache)."""
    from transformers import AutoModelForCausalLM

    from tree_dev.models.named import resolve_model
    from tree_dev.narrow_linear import use_narrow_linears

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32)
    use_narrow_linears(model.model)
    return model.model.eval()


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_smollm2_forward(benchmark, smollm2, rows):
    ids = torch.randint(0, 1000, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        benchmark(lambda: smollm2(ids))
