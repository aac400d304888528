"""Two small reference NKI kernels (tiled matmul, row softmax) used to test and
benchmark the executor; they run unchanged on the Neuron SDK."""

from __future__ import annotations

import torch

from kernels.nki.runtime import nisa, nki, nl


@nki.jit
def matmul_kernel(a_t, b):
    """``c[M, N] = a_t[K, M].T @ b[K, N]`` in 128 x 512 output tiles, K accumulated in
    PSUM 128 at a time. M, K multiples of 128; N a multiple of 512 (or < 512)."""
    k_dim, m_dim = a_t.shape
    _, n_dim = b.shape
    c = nl.ndarray((m_dim, n_dim), dtype=a_t.dtype, buffer=nl.shared_hbm)
    tm, tk = nl.tile_size.gemm_stationary_fmax, nl.tile_size.pmax
    tn = min(n_dim, nl.tile_size.gemm_moving_fmax)
    for m in nl.affine_range(m_dim // tm):
        for n in nl.affine_range(n_dim // tn):
            acc = nl.ndarray((tm, tn), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(k_dim // tk):
                a_tile = nl.load(a_t[k * tk : (k + 1) * tk, m * tm : (m + 1) * tm])
                b_tile = nl.load(b[k * tk : (k + 1) * tk, n * tn : (n + 1) * tn])
                nisa.nc_matmul(acc, a_tile, b_tile, accumulate=k > 0)
            out = nl.ndarray((tm, tn), dtype=a_t.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(out, acc)
            nl.store(c[m * tm : (m + 1) * tm, n * tn : (n + 1) * tn], out)
    return c


@nki.jit
def softmax_kernel(x):
    """Row softmax of ``x[R, C]`` (C <= 16K): 128 rows per tile, fp32 statistics."""
    rows, cols = x.shape
    y = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    p = nl.tile_size.pmax
    for r in nl.affine_range((rows + p - 1) // p):
        h = min(p, rows - r * p)
        t = nl.load(x[r * p : r * p + h, :])
        neg_max = nl.ndarray((h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(neg_max, nl.maximum, t, axis=1, negate=True, keepdims=True)
        e = nl.ndarray((h, cols), dtype=nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((h, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(
            e,
            nl.exp,
            t,
            bias=neg_max,
            reduce_op=nl.add,
            reduce_res=total,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        inv = nl.reciprocal(total)
        out = nl.ndarray((h, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(out, e, nl.multiply, inv)
        nl.store(y[r * p : r * p + h, :], out)
    return y


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` through :func:`matmul_kernel` (host transposes ``a``)."""
    return matmul_kernel(a.t().contiguous(), b)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax through :func:`softmax_kernel`."""
    return softmax_kernel(x)
