"""Per-engine instruction counts, HBM<->SBUF bytes and a roofline time estimate for
kernels run on the NumPy NKI executor.

Every executor instruction reports itself here (engine, elements per partition,
dtypes). Inside ``with profile() as p:`` the counts of all kernel launches add up
in ``p``; ``p.estimate()`` turns them into seconds per engine from published
Trainium2 (NeuronCore-v3) figures. It is an **estimate**, not a measurement:

- Tensor Engine, 2.4 GHz: one ``nc_matmul`` takes ``max(N, 64)`` cycles (N = moving
  free size; 64 = the documented matmul initiation latency), 4x that with fp32
  inputs; transposes are matmuls against an identity (N = partitions of the input).
  128x128 PEs x 2 FLOP x 2.4 GHz = 79 dense bf16 TFLOPS, the published peak.
- Vector Engine, 0.96 GHz, 256 elements/cycle (2 per partition; 512 = 4 per
  partition when every operand is bf16/fp16): ``inputs x free elements / lanes``.
- Scalar Engine, 1.2 GHz, 128 elements/cycle (1 per partition): free elements.
- GpSimd Engine, 1.2 GHz, 8 cores x 512 bit = 128 fp32 lanes: elements / 128.
- every compute instruction adds the documented ~60-cycle SBUF/PSUM access overhead.
- DMA: 16 engines x 23 B/ns = 368 GB/s per NeuronCore (Trn2), bytes / bandwidth;
  the ~1.3 us per-transfer start latency is reported as a count, not added (the
  queues overlap it).

Sources: the NKI Trainium2 architecture guide (engine widths and clocks, Tensor
Engine TFLOPS), the Trainium/Inferentia2 guide (cost model: ``max(N, 64)``,
~60-cycle access overhead, fp32 matmul 4x), the NKI DMA bandwidth guide (per-core
DMA bandwidth). ``roofline_s`` = the busiest engine (perfect overlap, a lower
bound); ``serial_s`` = the sum (no overlap, an upper bound on this model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

CLOCK_HZ = {"tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9}
ACCESS_OVERHEAD_CYCLES = 60
MATMUL_MIN_CYCLES = 64
DMA_BYTES_PER_S = 368e9
DMA_START_LATENCY_S = 1.3e-6
TENSOR_BF16_FLOPS = 128 * 128 * 2 * CLOCK_HZ["tensor"]


@dataclass
class Profile:
    """What a kernel run asked of each engine.

    ``instructions[engine]``: instruction counts; ``cycles[engine]``: the cost model's
    cycles; ``hbm_to_sbuf`` / ``sbuf_to_hbm``: DMA bytes between HBM and on-chip
    memory (``on_chip_dma`` for SBUF->SBUF); ``matmul_flops``: 2*K*M*N summed.
    """

    instructions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENGINES, 0))
    cycles: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINES[:4], 0.0))
    hbm_to_sbuf: int = 0
    sbuf_to_hbm: int = 0
    hbm_to_hbm: int = 0
    on_chip_dma: int = 0
    matmul_flops: int = 0
    launches: int = 0

    def estimate(self) -> dict[str, float]:
        """Seconds per engine, ``roofline_s`` (max) and ``serial_s`` (sum)."""
        out = {e: self.cycles[e] / CLOCK_HZ[e] for e in CLOCK_HZ}
        moved = self.hbm_to_sbuf + self.sbuf_to_hbm + 2 * self.hbm_to_hbm + self.on_chip_dma
        out["dma"] = moved / DMA_BYTES_PER_S
        out["roofline_s"] = max(out[e] for e in ENGINES)
        out["serial_s"] = sum(out[e] for e in ENGINES)
        out["bound"] = max(ENGINES, key=lambda e: out[e])
        return out

    def as_dict(self) -> dict:
        est = self.estimate()
        return {
            "instructions": dict(self.instructions),
            "cycles": {k: round(v) for k, v in self.cycles.items()},
            "hbm_to_sbuf_bytes": self.hbm_to_sbuf,
            "sbuf_to_hbm_bytes": self.sbuf_to_hbm,
            "hbm_to_hbm_bytes": self.hbm_to_hbm,
            "on_chip_dma_bytes": self.on_chip_dma,
            "matmul_flops": self.matmul_flops,
            "launches": self.launches,
            "estimate_s": est,
        }


_ACTIVE: list[Profile] = []


@contextlib.contextmanager
def profile() -> Iterator[Profile]:
    """Collect the cost of every kernel launch inside the block."""
    p = Profile()
    _ACTIVE.append(p)
    try:
        yield p
    finally:
        _ACTIVE.remove(p)


def active() -> bool:
    return bool(_ACTIVE)


def _add(engine: str, cycles: float) -> None:
    for p in _ACTIVE:
        p.instructions[engine] += 1
        p.cycles[engine] += cycles


def launch() -> None:
    for p in _ACTIVE:
        p.launches += 1


def _free(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1


def _two_byte(dtypes) -> bool:
    return all(np.dtype(d).itemsize == 2 and np.dtype(d).kind != "i" for d in dtypes)


def vector(shape: tuple[int, ...], inputs: int = 1, dtypes=()) -> None:
    """A Vector Engine instruction over tiles of ``shape`` reading ``inputs`` tiles."""
    if not _ACTIVE:
        return
    lanes = 4 if dtypes and _two_byte(dtypes) else 2
    _add("vector", max(inputs, 1) * _free(shape) / lanes + ACCESS_OVERHEAD_CYCLES)


def scalar(shape: tuple[int, ...]) -> None:
    if _ACTIVE:
        _add("scalar", _free(shape) + ACCESS_OVERHEAD_CYCLES)


def gpsimd(shape: tuple[int, ...]) -> None:
    if _ACTIVE:
        total = int(np.prod(shape, dtype=np.int64))
        _add("gpsimd", total / 128 + ACCESS_OVERHEAD_CYCLES)


def engine_op(engine_name: str, shape: tuple[int, ...], inputs: int = 1, dtypes=()) -> None:
    """Dispatch to the engine an instruction ran on (``vector`` / ``scalar`` / ``gpsimd``)."""
    if engine_name == "scalar":
        scalar(shape)
    elif engine_name == "gpsimd":
        gpsimd(shape)
    else:
        vector(shape, inputs, dtypes)


def matmul(k: int, m: int, n: int, fp32: bool) -> None:
    """One Tensor Engine matmul ``[K, M].T @ [K, N]``."""
    if not _ACTIVE:
        return
    _add("tensor", max(n, MATMUL_MIN_CYCLES) * (4 if fp32 else 1) + ACCESS_OVERHEAD_CYCLES)
    for p in _ACTIVE:
        p.matmul_flops += 2 * k * m * n


def dma(src_buffer: str, dst_buffer: str, nbytes: int) -> None:
    """One DMA of ``nbytes`` from ``src_buffer`` to ``dst_buffer``."""
    if not _ACTIVE:
        return
    src_chip = src_buffer in ("sbuf", "psum")
    dst_chip = dst_buffer in ("sbuf", "psum")
    for p in _ACTIVE:
        p.instructions["dma"] += 1
        if src_chip and dst_chip:
            p.on_chip_dma += nbytes
        elif dst_chip:
            p.hbm_to_sbuf += nbytes
        elif src_chip:
            p.sbuf_to_hbm += nbytes
        else:
            p.hbm_to_hbm += nbytes
