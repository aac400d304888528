"""The measured KV layout reads back exactly what vLLM's own CPU cache write stored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup installs it)")

from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackendImpl,
    _get_attn_isa,
)

from tree_dev.vllm_plugin.kv_layout import KVLayout, contiguous_kv  # noqa: E402


def cpu_impl(dtype, block_size, head_size):
    """vLLM's own ``do_kv_cache_update`` on a minimal impl/layer pair."""
    impl = SimpleNamespace(attn_type="decoder", kv_cache_dtype="auto")
    impl.do_kv_cache_update = lambda layer, k, v, cache, slots: (
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, k, v, cache, slots)
    )
    layer = SimpleNamespace(
        isa=_get_attn_isa(dtype, block_size, head_size), _k_scale_float=1.0, _v_scale_float=1.0
    )
    return impl, layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, hkv, d", [(128, 2, 64), (32, 1, 128), (64, 4, 32)])
def test_layout_round_trip(dtype, block_size, hkv, d):
    impl, layer = cpu_impl(dtype, block_size, d)
    num_blocks = 5
    cache = torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=dtype)
    lay = KVLayout.discover(impl, layer, cache)
    g = torch.Generator().manual_seed(block_size + hkv + d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:50]
    k = torch.randn(50, hkv, d, generator=g).to(dtype)
    v = torch.randn(50, hkv, d, generator=g).to(dtype)
    impl.do_kv_cache_update(layer, k, v, cache, slots)
    k2, v2 = lay.gather_slots(cache, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)  # integer-exact: a pure data move
    views = lay.paged_views(cache)
    if dtype == torch.float32:  # fp32 on x86 is affine: read in place, no copy
        assert views is not None and views[0].data_ptr() >= cache.data_ptr()
    if views is not None:
        blocks, offs = slots // block_size, slots % block_size
        assert torch.equal(views[0][blocks, offs], k) and torch.equal(views[1][blocks, offs], v)
    # whole blocks through a block table, token-major
    table = torch.tensor([[3, 1], [0, 4]])
    kc, vc = contiguous_kv(lay, cache, table, [block_size + 3, 7])
    for b in range(2):
        for t in (0, 5):
            slot = int(table[b, t // block_size]) * block_size + t % block_size
            ks, vs = lay.gather_slots(cache, torch.tensor([slot]))
            assert torch.equal(kc[b, t], ks[0]) and torch.equal(vc[b, t], vs[0])


def test_fp32_keys_are_not_stored_row_major():
    """The reason the layout is measured: reading K as plain rows would be wrong."""
    impl, layer = cpu_impl(torch.float32, 128, 64)
    cache = torch.zeros(1, 2, 128, 128)
    lay = KVLayout.discover(impl, layer, cache)
    naive = torch.arange(128 * 2 * 64).view(128, 2, 64)  # where row-major K would sit
    assert not torch.equal(lay.k_index, naive)


def test_quantized_cache_refused():
    impl, layer = cpu_impl(torch.float32, 32, 32)
    with pytest.raises(ValueError, match="not supported"):
        KVLayout.discover(impl, layer, torch.zeros(1, 1, 32, 64, dtype=torch.uint8))
