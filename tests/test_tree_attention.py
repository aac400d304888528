"""Tree attention: every backend against ``kernels.reference.tree_attention``.

One suite parametrised over backends. ``LIMITS`` keeps the slow paths (the Triton
interpreter, the NKI executor) on small shapes: most tree nodes, longest prefix,
hypothesis examples. Independent oracles for edge cases: a one-node tree is
single-query decode attention, a chain is causal attention (both plain SDPA).
Unused cache slots are NaN, so reading outside a request's prefix + tree shows.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import reference
from tests.factories import BACKENDS, random_tree
from tree_dev.tree import TokenTree, TreeBatch

# max_nodes: largest tree drawn; max_prefix: longest prefix drawn; examples: hypothesis runs;
# max_kv_heads: KV heads drawn (the interpreter pays per program).
LIMITS = {
    "torch": dict(max_nodes=256, max_prefix=3000, examples=40, max_kv_heads=4),
    "triton": dict(max_nodes=256, max_prefix=700, examples=25, max_kv_heads=2),
    "nki": dict(max_nodes=128, max_prefix=300, examples=4, max_kv_heads=1),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (atol, rtol) of the output and atol of the LSE. fp32: summation-order noise only.
# fp16/bf16: the output is rounded to the dtype (bf16: 2^-8 relative), and the fused
# prefix kernel rounds its partial output before the LSE merge.
TOL = {
    torch.float32: (2e-5, 1e-5, 1e-4),
    torch.float16: (1e-2, 1e-2, 1e-3),
    torch.bfloat16: (1e-2, 1e-2, 1e-3),
}


# ----------------------------------------------------------------------------- inputs
@st.composite
def trees(draw, max_nodes: int) -> TokenTree:
    n = draw(st.one_of(st.integers(1, 8), st.integers(1, max_nodes)))
    width = draw(st.sampled_from([None, None, 1, 2, 8]))
    return random_tree(n, draw(st.integers(0, 2**31 - 1)), width)


@st.composite
def prefix_lens(draw, block: int, max_prefix: int) -> int:
    """0, shorter than a block, a multiple of the block, or anything up to ``max_prefix``."""
    return draw(
        st.one_of(
            st.just(0),
            st.integers(1, block - 1),
            st.integers(1, max(1, max_prefix // block)).map(lambda k: k * block),
            st.integers(1, max_prefix),
        )
    )


def make_inputs(
    tree_list: list[TokenTree],
    plens: list[int],
    hkv: int,
    group: int,
    d: int,
    dtype: torch.dtype,
    block_size: int | None,
    seed: int = 0,
    device: str = "cpu",
) -> dict:
    """Queries, a paged (``block_size``) or contiguous (None) cache and its block table.

    Slots outside each request's prefix + tree hold NaN. Paged blocks are shuffled.
    """
    gen = torch.Generator().manual_seed(seed)
    tb = TreeBatch(tree_list)
    b = len(tree_list)
    need = [p + t.num_nodes for p, t in zip(plens, tree_list, strict=True)]
    q = torch.randn(tb.total_nodes, hkv * group, d, generator=gen)
    if block_size is None:
        slots = max(need) + 3
        k = torch.full((b, slots, hkv, d), float("nan"))
        v = torch.full((b, slots, hkv, d), float("nan"))
        for r, m in enumerate(need):
            k[r, :m] = torch.randn(m, hkv, d, generator=gen)
            v[r, :m] = torch.randn(m, hkv, d, generator=gen)
        table = None
    else:
        nblk = [math.ceil(m / block_size) for m in need]
        width = max(nblk) + 1
        num_blocks = sum(nblk) + 2
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(b, width, dtype=torch.int32)
        k = torch.full((num_blocks, block_size, hkv, d), float("nan"))
        v = torch.full((num_blocks, block_size, hkv, d), float("nan"))
        used = 0
        for r, m in enumerate(need):
            table[r, : nblk[r]] = perm[used : used + nblk[r]]
            used += nblk[r]
            flat_k = torch.randn(m, hkv, d, generator=gen)
            flat_v = torch.randn(m, hkv, d, generator=gen)
            for pos in range(m):
                blk = int(table[r, pos // block_size])
                k[blk, pos % block_size] = flat_k[pos]
                v[blk, pos % block_size] = flat_v[pos]
        table = table.to(device)
    return dict(
        q=q.to(device, dtype),
        k_cache=k.to(device, dtype),
        v_cache=v.to(device, dtype),
        tree=tb.to(device),
        prefix_lens=torch.tensor(plens, dtype=torch.int64, device=device),
        block_table=table,
    )


def assert_matches_reference(backend: str, inputs: dict, scale: float | None = None) -> None:
    out, lse = kernels.tree_attention(**inputs, scale=scale, return_lse=True, backend=backend)
    ref_in = {k: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    ref_in["tree"] = inputs["tree"].to("cpu")
    ref_out, ref_lse = reference.tree_attention(**ref_in, scale=scale, return_lse=True)
    atol, rtol, lse_atol = TOL[inputs["q"].dtype]
    assert out.dtype == inputs["q"].dtype and out.shape == inputs["q"].shape
    assert lse.dtype == torch.float32 and lse.shape == inputs["q"].shape[:2]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=lse_atol, rtol=1e-5)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


# ----------------------------------------------------------------------------- vs reference
def test_random_cases_match_reference(backend: str, monkeypatch) -> None:
    import kernels.torchops.tree_attention as torch_mod

    lim = LIMITS[backend]

    @settings(max_examples=lim["examples"], deadline=None)
    @given(data=st.data())
    def check(data) -> None:
        block = data.draw(st.sampled_from([None, 16, 32, 64]), label="block_size")
        bsz = data.draw(st.integers(1, 3), label="batch")
        tree_list = [data.draw(trees(lim["max_nodes"]), label="tree") for _ in range(bsz)]
        plens = [
            data.draw(prefix_lens(block or 32, lim["max_prefix"]), label="prefix")
            for _ in range(bsz)
        ]
        inputs = make_inputs(
            tree_list,
            plens,
            hkv=data.draw(st.integers(1, lim["max_kv_heads"]), label="kv_heads"),
            group=data.draw(st.sampled_from([1, 4, 8]), label="gqa"),
            d=data.draw(st.sampled_from([64, 128]), label="head_dim"),
            dtype=data.draw(st.sampled_from(list(DTYPES.values())), label="dtype"),
            block_size=block,
            seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
        )
        scale = data.draw(st.sampled_from([None, 0.05]), label="scale")
        if backend == "torch":  # the torch row tiles: batched when small, by default
            small = data.draw(st.sampled_from([0, 256 << 10, 1 << 40]), label="small_tile")
            monkeypatch.setattr(torch_mod, "_SMALL_TILE_BYTES", small)
        assert_matches_reference(backend, inputs, scale)

    check()


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_ragged_batch_each_dtype(backend: str, dtype: str, paged: bool) -> None:
    """Three requests: different tree shapes and prefixes (0, < block, not a multiple)."""
    n_big = min(LIMITS[backend]["max_nodes"], 70)
    tree_list = [random_tree(n_big, 1), TokenTree.chain(4), random_tree(1, 2)]
    plens = [0, 5, min(LIMITS[backend]["max_prefix"], 77)]
    inputs = make_inputs(tree_list, plens, 2, 4, 64, DTYPES[dtype], 16 if paged else None, 3)
    assert_matches_reference(backend, inputs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_inputs_are_not_modified(backend: str, dtype: str) -> None:
    """Queries, caches and the block table are read only (an in-place scale of an fp32
    query view would corrupt the caller's q)."""
    inputs = make_inputs(
        [random_tree(9, 1), random_tree(4, 2)], [40, 3], 2, 4, 64, DTYPES[dtype], 16
    )
    before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    kernels.tree_attention(**inputs, backend=backend)
    for name, old in before.items():  # unused cache slots are NaN: equal_nan
        torch.testing.assert_close(inputs[name], old, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_and_head_dims(backend: str, group: int, d: int) -> None:
    inputs = make_inputs([random_tree(23, group)], [130], 2, group, d, torch.float32, 32, 5)
    assert_matches_reference(backend, inputs)


def test_largest_tree(backend: str) -> None:
    """The biggest tree the backend takes (256 nodes = 4 packed words for Triton)."""
    n = LIMITS[backend]["max_nodes"]
    inputs = make_inputs([random_tree(n, 7, width=3)], [40], 1, 4, 64, torch.float32, 16, 7)
    assert_matches_reference(backend, inputs)


@pytest.mark.full  # 32K-token prefixes through the interpreters
def test_32k_prefix(backend: str) -> None:
    inputs = make_inputs(
        [random_tree(64, 11), random_tree(9, 12)], [32768, 32001], 1, 4, 64, torch.bfloat16, 256
    )
    assert_matches_reference(backend, inputs)


# ----------------------------------------------------------------------------- independent oracles
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_single_node_is_decode_attention(backend: str, paged: bool) -> None:
    """N=1: the root sees the prefix and itself: plain single-query SDPA."""
    plens = [0, 3, min(LIMITS[backend]["max_prefix"], 200)]
    inputs = make_inputs(
        [TokenTree.chain(0)] * 3, plens, 2, 4, 64, torch.float32, 16 if paged else None
    )
    out = kernels.tree_attention(**inputs, backend=backend)
    for r, p in enumerate(plens):
        k = reference.gather_kv(inputs["k_cache"], inputs["block_table"], r, p + 1)
        v = reference.gather_kv(inputs["v_cache"], inputs["block_table"], r, p + 1)
        want = F.scaled_dot_product_attention(
            inputs["q"][r][None, :, None],  # [1, Hq, 1, D]
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            enable_gqa=True,
        )[0, :, 0]
        torch.testing.assert_close(out[r], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chain_is_causal_attention(backend: str, dtype: str) -> None:
    """A chain after a prefix: causal SDPA over prefix + chain, last rows."""
    n, plen, hkv, group, d = 12, min(LIMITS[backend]["max_prefix"], 150), 2, 4, 64
    inputs = make_inputs([TokenTree.chain(n - 1)], [plen], hkv, group, d, DTYPES[dtype], 32)
    out = kernels.tree_attention(**inputs, backend=backend)
    k = reference.gather_kv(inputs["k_cache"], inputs["block_table"], 0, plen + n).float()
    v = reference.gather_kv(inputs["v_cache"], inputs["block_table"], 0, plen + n).float()
    q_all = torch.randn(plen + n, hkv * group, d)  # prefix queries: anything
    q_all[plen:] = inputs["q"].float()
    want = F.scaled_dot_product_attention(
        q_all.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=True,
    )[0].transpose(0, 1)[plen:]
    atol, rtol, _ = TOL[DTYPES[dtype]]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- bad input
@pytest.fixture
def no_kernel(monkeypatch, backend: str):
    """Make the backend's op record calls, keeping its ``max_tree_nodes``."""
    calls: list[int] = []
    real = kernels._resolve

    def resolve(op, name, device):
        fn = real(op, name, device)

        def spy(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)

        if hasattr(fn, "max_tree_nodes"):
            spy.max_tree_nodes = fn.max_tree_nodes
        return spy

    monkeypatch.setattr(kernels, "_resolve", resolve)
    return calls


def _small_inputs(n: int = 5, plen: int = 20) -> dict:
    return make_inputs([random_tree(n, 0)], [plen], 2, 4, 64, torch.float32, 16)


def _rejects(backend: str, calls: list[int], match: str, **inputs) -> None:
    with pytest.raises(ValueError, match=match):
        kernels.tree_attention(**inputs, backend=backend)
    assert calls == [], "the kernel ran before the input was rejected"


def test_rejects_bad_q_shape(backend, no_kernel):
    inputs = _small_inputs()
    inputs["q"] = inputs["q"][:, :, :32].contiguous()
    _rejects(backend, no_kernel, "head_dim", **inputs)
    inputs = _small_inputs()
    inputs["q"] = inputs["q"][:4]
    _rejects(backend, no_kernel, "rows", **inputs)


def test_rejects_bad_head_count(backend, no_kernel):
    inputs = _small_inputs()
    inputs["q"] = inputs["q"][:, :7].contiguous()
    _rejects(backend, no_kernel, "multiple of num_kv_heads", **inputs)


def test_rejects_dtype_mismatch(backend, no_kernel):
    inputs = _small_inputs()
    inputs["k_cache"] = inputs["k_cache"].half()
    _rejects(backend, no_kernel, "dtype", **inputs)


def test_rejects_device_mismatch(backend, no_kernel):
    inputs = _small_inputs()
    inputs["v_cache"] = inputs["v_cache"].to("meta")
    _rejects(backend, no_kernel, "device|same device", **inputs)


def test_rejects_tree_too_large(backend, no_kernel):
    limit = getattr(_real_op(backend), "max_tree_nodes", None)
    if limit is None:  # no size limit: a big tree must simply work
        inputs = make_inputs([random_tree(300, 0)], [3], 1, 1, 64, torch.float32, 16)
        assert_matches_reference(backend, inputs)
        return
    inputs = make_inputs([random_tree(limit + 1, 0)], [3], 1, 1, 64, torch.float32, 16)
    _rejects(backend, no_kernel, f"at most {limit}", **inputs)


def test_rejects_short_block_table(backend, no_kernel):
    inputs = _small_inputs(n=5, plen=60)  # 65 tokens: 5 blocks of 16
    inputs["block_table"] = inputs["block_table"][:, :4]
    _rejects(backend, no_kernel, "block_table has 4 columns", **inputs)


def _real_op(backend: str):
    module = importlib.import_module(kernels.BACKENDS[backend] + ".tree_attention")
    return module.tree_attention


def test_triton_limit_is_256():
    assert _real_op("triton").max_tree_nodes == 256


# ----------------------------------------------------------------------------- torch specifics
class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return result


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_torch_builds_no_dense_mask(paged: bool, dtype: str):
    """No mask wider than the tree, and no tensor spanning the tree rows and the prefix
    beyond one bounded score tile (the row-tile path), though all rows' scores here
    (2 x 4 x 100 x 2100 fp32 = 6.7 MB) would not fit in one."""
    import kernels.torchops.tree_attention as mod

    n, plen, hkv, group = 100, 2000, 2, 4
    inputs = make_inputs(
        [random_tree(n, 3)], [plen], hkv, group, 64, DTYPES[dtype], 16 if paged else None
    )
    assert hkv * group * n * (plen + n) * 4 > mod._TILE_BYTES
    with _Shapes() as rec:
        out = kernels.tree_attention(**inputs, backend="torch", check_inputs=False)
    assert torch.isfinite(out).all() and rec.shapes
    spanning = []
    for shape in rec.shapes:
        spans_rows = n in shape or n * group in shape
        spans_prefix = any(s >= plen for s in shape)
        if spans_rows and spans_prefix:
            spanning.append(shape)
            assert math.prod(shape) * 4 <= mod._TILE_BYTES, f"[rows, prefix] tensor {shape}"
    assert len(spanning) > 1, spanning  # several bounded tiles


def _spy_paths(monkeypatch) -> list[str]:
    import kernels.torchops.tree_attention as mod

    taken: list[str] = []
    for name in ("_small_group", "_row_tile_group", "_split_group"):
        real = getattr(mod, name)

        def spy(*args, real=real, name=name, **kwargs):
            taken.append(name.strip("_").split("_")[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, name, spy)
    return taken


@pytest.mark.parametrize(
    "dtype, n, plen, path",
    [
        ("bf16", 12, 100, "small"),  # 2 heads x 12 x 112 fp32 scores <= 256 KB: one tile
        ("fp32", 12, 100, "small"),
        ("bf16", 12, 3000, "row"),  # 2 x 12 x 3012 x 4 B > 256 KB
        ("bf16", 12, 5000, "row"),  # two key pieces
        ("fp32", 12, 3000, "row"),
        ("bf16", 500, 10, "split"),  # one head's [n, 4096 + n] fp32 scores > 8 MB
        ("fp32", 500, 10, "split"),
        ("fp16", 12, 100, "split"),
        ("fp16", 12, 1000, "split"),
    ],
)
def test_torch_path_choice(monkeypatch, dtype: str, n: int, plen: int, path: str):
    """bf16 and fp32 on the CPU take the row tiles (one batched tile when small) unless
    the tree is huge; fp16 the fused pass."""
    taken = _spy_paths(monkeypatch)
    inputs = make_inputs([random_tree(n, 1)], [plen], 1, 2, 64, DTYPES[dtype], None)
    assert_matches_reference("torch", inputs)
    assert taken == [path]


@pytest.mark.parametrize(
    "tile_bytes, piece_keys",
    [(None, None), (1 << 14, None), (None, 64), (1 << 14, 40)],
    ids=["one-tile", "per-head-tiles", "key-pieces", "both"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize(
    "dtype, pv_onednn_rows",
    [("bf16", None), ("fp32", 0), ("fp32", 10**9)],
    ids=["bf16", "fp32-pv-onednn", "fp32-pv-matmul"],
)
def test_torch_row_tiles(
    monkeypatch,
    paged: bool,
    tile_bytes: int | None,
    piece_keys: int | None,
    dtype: str,
    pv_onednn_rows: int | None,
):
    """Row-tile path on a ragged batch: prefix 0, a group with non-adjacent rows (requests
    0 and 2), GQA 4; one tile per request or one query head per tile; the keys in one
    piece or in several merged by LSE (prefixes of 1, 2 and 3 pieces); fp32 ``P V``
    through oneDNN (with V^T copied) or through ``matmul``."""
    import kernels.torchops.tree_attention as mod

    monkeypatch.setattr(mod, "_SMALL_TILE_BYTES", 0)  # these shapes are small
    if pv_onednn_rows is not None:
        monkeypatch.setattr(mod, "_PV_ONEDNN_ROWS", pv_onednn_rows)
    if tile_bytes is not None:
        monkeypatch.setattr(mod, "_TILE_BYTES", tile_bytes)
    if piece_keys is not None:
        monkeypatch.setattr(mod, "_ROW_TILE_KEYS", piece_keys)
    taken = _spy_paths(monkeypatch)
    tree_list = [random_tree(5, 1), random_tree(9, 2), random_tree(5, 3), TokenTree.chain(2)]
    plens = [100, 17, 100, 0]
    block = 16 if paged else None
    inputs = make_inputs(tree_list, plens, 2, 4, 64, DTYPES[dtype], block)
    assert_matches_reference("torch", inputs)
    assert set(taken) == {"row"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_torch_small_groups(monkeypatch, dtype: str, paged: bool):
    """A small request alone is one tile (requests 0, 1, 4: prefix 50, 9 and 0); small
    requests of one shape (2 and 3) go together through the fused route."""
    taken = _spy_paths(monkeypatch)
    tree_list = [random_tree(6, 1), TokenTree.chain(3), random_tree(5, 2), random_tree(5, 3)]
    tree_list += [random_tree(4, 4)]
    plens = [50, 9, 30, 30, 0]
    inputs = make_inputs(tree_list, plens, 2, 4, 64, DTYPES[dtype], 16 if paged else None)
    assert_matches_reference("torch", inputs)
    assert sorted(taken) == ["small", "small", "small", "split"]


@pytest.mark.parametrize("route", ["small", "row", "fused"])
def test_torch_consecutive_paged_blocks(monkeypatch, route: str):
    """Requests whose pages are consecutive blocks are read as views of the paged cache
    (no gather): same result as the reference, and as the cache's contiguous layout."""
    import kernels.torchops.tree_attention as mod

    monkeypatch.setattr(mod, "_SMALL_TILE_BYTES", 1 << 40 if route == "small" else 0)
    contiguous = make_inputs(
        [random_tree(9, 1), random_tree(5, 2)], [37, 70], 2, 4, 64, torch.float32, None
    )
    b, slots = contiguous["k_cache"].shape[:2]
    bs = 16
    pad = -slots % bs  # whole pages of NaN after each request
    paged = dict(contiguous)
    for name in ("k_cache", "v_cache"):
        cache = torch.nn.functional.pad(contiguous[name], (0, 0, 0, 0, 0, pad), value=float("nan"))
        paged[name] = cache.view(-1, bs, *cache.shape[2:])
    per_req = (slots + pad) // bs
    paged["block_table"] = torch.arange(b * per_req, dtype=torch.int32).view(b, per_req)
    taken = _spy_paths(monkeypatch)
    real_workspace = mod._workspace

    def no_gather(slot: str, *args, **kwargs):
        assert slot not in ("k", "v"), "pages gathered, not viewed"
        return real_workspace(slot, *args, **kwargs)

    monkeypatch.setattr(mod, "_workspace", no_gather)
    fused = route == "fused"
    out = mod.tree_attention(**paged, route="fused" if fused else "auto")
    want = mod.tree_attention(**contiguous, route="fused" if fused else "auto")
    assert set(taken) == {"split" if fused else route}
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(out, reference.tree_attention(**paged), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_row_tiles_without_onednn(monkeypatch, dtype: str):
    """torch builds without oneDNN: the row tiles' fp32 GEMMs fall back to ``matmul``."""
    import kernels.torchops.tree_attention as mod

    monkeypatch.setattr(mod, "_SMALL_TILE_BYTES", 0)
    monkeypatch.setattr(mod, "_ONEDNN_LINEAR", None)
    monkeypatch.setattr(mod, "_PV_ONEDNN_ROWS", 0)
    inputs = make_inputs(
        [random_tree(30, 4), random_tree(3, 5)], [200, 0], 2, 4, 64, DTYPES[dtype], 16
    )
    assert_matches_reference("torch", inputs)


def test_gemm_nt_matches_matmul():
    """The oneDNN fp32 GEMM is plain fp32 arithmetic (no reduced-precision shortcut)."""
    import kernels.torchops.tree_attention as mod

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(96, 128, generator=gen)
    b = torch.randn(300, 128, generator=gen)
    exact = (a.double() @ b.double().T).float()
    # fp32 accumulation over 128 products of N(0,1) values: error ~1e-5 at most.
    torch.testing.assert_close(mod._gemm_nt(a, b), exact, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_inside_then_outside_inference_mode(dtype: str):
    """Workspaces and cached plans made under ``torch.inference_mode()`` (as the engine
    runs) are not reused outside it, where writing an inference tensor is an error."""
    inputs = make_inputs(
        [random_tree(7, 1), random_tree(4, 2)], [40, 70], 2, 4, 64, DTYPES[dtype], 16
    )
    with torch.inference_mode():
        inside = kernels.tree_attention(**inputs, backend="torch")
    outside = kernels.tree_attention(**inputs, backend="torch")
    assert not outside.is_inference()
    torch.testing.assert_close(outside, inside, atol=0, rtol=0)
    assert_matches_reference("torch", inputs)


def test_torch_bf16_keeps_fp32_scores():
    """Peaked logits (score std ~10): bf16-rounded scores would miss the tolerance; the
    row tiles (like the fused kernel) compute ``Q K^T`` in fp32."""
    inputs = make_inputs(
        [random_tree(40, 4), random_tree(7, 5)], [900, 33], 2, 4, 64, torch.float32, 16
    )
    inputs["q"] = (inputs["q"] * 10).to(torch.bfloat16)
    inputs["k_cache"] = inputs["k_cache"].to(torch.bfloat16)
    inputs["v_cache"] = inputs["v_cache"].to(torch.bfloat16)
    assert_matches_reference("torch", inputs)


def test_torch_plan_is_cached_per_prefix_lengths():
    """Grouping and unpacked masks are computed once per (tree batch, lengths, dtype)."""
    import kernels.torchops.tree_attention as mod

    inputs = make_inputs(
        [random_tree(6, 1), random_tree(6, 2)], [10, 10], 1, 2, 64, torch.float32, None
    )
    tb = inputs["tree"]
    first = mod._plan(tb, inputs["prefix_lens"], torch.float32, 2)
    assert mod._plan(tb, inputs["prefix_lens"], torch.float32, 2) is first
    assert len(first) == 1 and first[0].reqs == [0, 1]  # same (prefix, size): one group
    other = mod._plan(tb, torch.tensor([10, 11]), torch.float32, 2)
    assert other is not first and len(other) == 2
    assert mod._plan(tb, inputs["prefix_lens"], torch.float32, 8) is not first  # heads
    for i in range(mod._PLANS_PER_TREE + 2):  # bounded
        mod._plan(tb, torch.tensor([i, i]), torch.float32, 2)
    assert len(mod._PLANS[tb]) == mod._PLANS_PER_TREE


def assert_matches_fused_route(inputs: dict) -> None:
    """The torch backend's fused route (``route="fused"``) against the reference."""
    from kernels.torchops.tree_attention import tree_attention as torch_tree_attention

    out, lse = torch_tree_attention(**inputs, return_lse=True, route="fused")
    ref_out, ref_lse = reference.tree_attention(**inputs, return_lse=True)
    atol, rtol, lse_atol = TOL[inputs["q"].dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=lse_atol, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_torch_fused_route_on_request(monkeypatch, dtype: str, paged: bool):
    """``route="fused"`` takes the fused pass where ``"auto"`` takes the row tiles;
    both match the reference; an unknown route is a ValueError."""
    from kernels.torchops.tree_attention import tree_attention as torch_tree_attention

    taken = _spy_paths(monkeypatch)
    inputs = make_inputs(
        [random_tree(12, 1), random_tree(5, 2)],
        [300, 40],
        2,
        4,
        64,
        DTYPES[dtype],
        16 if paged else None,
    )
    assert_matches_fused_route(inputs)
    assert set(taken) == {"split"}
    taken.clear()
    assert_matches_reference("torch", inputs)
    assert set(taken) == {"small"}
    with pytest.raises(ValueError, match="route"):
        torch_tree_attention(**inputs, route="dense")


def test_torch_fallback_without_fused_cpu_kernel(monkeypatch):
    """The device-agnostic prefix path (chunked fp32 matmuls) also matches."""
    import kernels.torchops.tree_attention as mod

    monkeypatch.setattr(mod, "_FLASH_CPU", None)
    monkeypatch.setattr(mod, "_CHUNK", 64)
    inputs = make_inputs(
        [random_tree(30, 4), random_tree(3, 5)], [200, 0], 2, 4, 64, torch.float32, 16
    )
    assert_matches_fused_route(inputs)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_torch_long_prefix_in_pieces(monkeypatch, dtype: str):
    """On the fused route (fp16, huge trees), long prefixes go through the fused kernel
    in pieces merged by LSE (tiny pieces here)."""
    import kernels.torchops.tree_attention as mod

    monkeypatch.setattr(mod, "_KV_SPLIT", 64)
    inputs = make_inputs(
        [random_tree(20, 8), random_tree(4, 9)], [700, 129], 2, 4, 64, DTYPES[dtype], 16
    )
    assert_matches_fused_route(inputs)


# ----------------------------------------------------------------------------- triton specifics
@pytest.mark.parametrize("splits", [2, 5])
def test_triton_split_prefix_matches_reference(splits: int):
    """Split-KV (flash-decoding) path: partial prefixes merged by the second kernel."""
    from kernels.triton.tree_attention import _tree_attention

    inputs = make_inputs(
        [random_tree(9, 6), random_tree(1, 7)], [300, 40], 1, 4, 64, torch.bfloat16, 32
    )
    out, lse = _tree_attention(**inputs, return_lse=True, num_splits=splits)
    ref_out, ref_lse = reference.tree_attention(**inputs, return_lse=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 80])
def test_triton_small_tiles(d: int):
    """16/32-wide tiles: many query blocks, prefix tiles + tail, tree tiles across words;
    a head dim that is not a power of two (masked lanes)."""
    from kernels.triton.tree_attention import _tree_attention

    inputs = make_inputs(
        [random_tree(70, 10, width=4), random_tree(3, 11)], [77, 130], 1, 2, d, torch.float32, 16
    )
    out, lse = _tree_attention(**inputs, return_lse=True, config=(32, 16, 4, 1))
    ref_out, ref_lse = reference.tree_attention(**inputs, return_lse=True)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_triton_matches_reference(dtype: str, paged: bool):
    tree_list = [random_tree(64, 1), random_tree(256, 2, width=4), TokenTree.chain(0)]
    inputs = make_inputs(
        tree_list, [8192, 1000, 0], 8, 4, 128, DTYPES[dtype], 16 if paged else None, 1, "cuda"
    )
    assert_matches_reference("triton", inputs)
    assert_matches_reference("auto", inputs)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("splits", [1, 7, 32])
def test_cuda_triton_splits(splits: int):
    from kernels.triton.tree_attention import _tree_attention

    inputs = make_inputs(
        [random_tree(64, 3), random_tree(17, 4)],
        [8000, 33],
        8,
        4,
        128,
        torch.bfloat16,
        16,
        2,
        "cuda",
    )
    out, lse = _tree_attention(**inputs, return_lse=True, num_splits=splits)
    ref_in = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    ref_in["tree"] = inputs["tree"].to("cpu")
    ref_out, ref_lse = reference.tree_attention(**ref_in, return_lse=True)
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-5)


@pytest.mark.gpu
@cuda
def test_cuda_torch_backend_matches_reference():
    inputs = make_inputs([random_tree(40, 5)], [3000], 2, 4, 64, torch.float32, 16, 3, "cuda")
    assert_matches_reference("torch", inputs)
