"""What a step costs: ``CostModel`` (seconds from a step's ``Shape``, fitted at start-up by
``measure``, corrected online) and its JSON cache per model and machine."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tree_dev.auto.shapes import Shape


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns, exactly: the unconstrained fit on every
    subset of columns, the best one whose coefficients are all >= 0 (the NNLS optimum is the
    unconstrained fit on its own support). Each subset is solved on the normal equations
    (``x.T @ x``, a few columns square), so the samples are read once, not per subset.
    Deterministic; no scipy needed."""
    n = x.shape[1]
    gram, xty, yy = x.T @ x, x.T @ y, float(y @ y)
    best, best_res = np.zeros(n), yy
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub = gram[np.ix_(cols, cols)]  # |x c - y|^2 = y.y - 2 c.(x.y) + c.(x.x)c
        coef = np.linalg.lstsq(sub, xty[cols], rcond=None)[0]
        if np.any(coef < 0):
            continue
        res = yy - 2 * float(coef @ xty[cols]) + float(coef @ sub @ coef)
        if res < best_res - 1e-12 * max(yy, 1e-300):
            best, best_res = np.zeros(n), res
            best[cols] = coef
    return best


#: the coefficients of ``CostModel`` (``coefficients()``, ``to_json``, the engines' stats)
COEFFICIENTS = "abcdefg"


@dataclass
class CostModel:
    """Step seconds = ``correction * (a + b*verify_rows + c*draft_levels + d*draft_rows +
    e*branched + f*drafted + g*requests)``, with what a step's drafts add scaled by
    ``drafted_factor``.

    ``a..g`` >= 0 (seconds, seconds per row / level / branched tree, seconds of a step
    that verifies any draft over a plain one, seconds per request), fitted by ``fit``.
    Two online corrections follow the measured steps (``observe``), each a decayed ratio
    clipped to its bounds:

    - ``correction``, of every step: ``sum(decay^i * measured_i) / sum(decay^i *
      raw_i)``, in ``bounds``. A uniform factor: it never changes which trees win.
    - ``drafted_factor`` ``k`` and ``drafted_offset`` ``o`` (seconds, uncorrected), of
      the steps with drafts: what they took over the plain step of as many requests
      (``plain_of``), at ``correction``, is fitted as ``k * extra + o``, ``extra`` what
      the model says their drafts add (``raw(shape) - raw(plain_of(shape))``): a decayed
      least squares over those steps that leans ``k`` towards 1 where their ``extra``
      hardly varies (then ``o`` takes the gap), ``k`` in ``drafted_bounds`` (1 to 2)
      and ``o`` in 0 to a plain step of one request (``drafted_offset_max``): a tree is
      never priced below the fit (on the toy its cheap tries ran at 0.55x the fit while
      its draft model's trees ran at it, so a factor below 1 made those look half their
      price). Both change which trees win: served traffic is mostly plain steps, so a
      fit can be right on them and wrong by a third on the few with drafts (SmolLM2 at 4
      concurrent: 18.8 ms measured, 14.4 ms predicted), and a fit can put the fixed cost
      of leaving the plain path on its branched term, so that a chain trie's step reads
      as free (the toy at 8 concurrent, T=0.8: 2.5 ms measured, 0.2 ms predicted) where
      no factor helps and an offset does. ``priced()`` is the model with both folded into the
      coefficients (``choose``'s).

    >>> m = CostModel(a=0.010, b=0.0001, c=0.001, d=0.0, e=0.002, f=0.003)
    >>> round(m.predict(Shape(33, 6, 21)), 6), round(m.predict(Shape(33, 6, 21, 1, 1)), 6)
    (0.0193, 0.0243)
    """

    a: float
    b: float
    c: float
    d: float
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0
    correction: float = 1.0
    correction_decay: float = 0.9
    bounds: tuple[float, float] = (0.5, 2.0)
    drafted_factor: float = 1.0
    #: ``drafted_factor``'s: never below 1 (one factor for every tree: the toy's tries,
    #: measured at 0.55x what the fit says, took its draft model's trees down with them)
    drafted_bounds: tuple[float, float] = (1.0, 2.0)
    #: seconds (uncorrected) every step with drafts takes beyond the fit, at least 0 and
    #: at most ``drafted_offset_max`` plain steps of one request (``a + b + g``)
    drafted_offset: float = 0.0
    #: the cap on ``drafted_offset``, in plain steps of one request, applied where it is
    #: read (0: no offset, the factor alone, as before it; ``bench.auto_ab`` A/Bs it)
    drafted_offset_max: float = 1.0
    #: False: ``drafted_factor`` and ``drafted_offset`` stay as they are (a model given,
    #: for a choice that does not depend on timing; ``correction`` never changes one)
    learn_drafted: bool = True
    samples: int = 0  # steps the fit used
    rel_rms: float = 0.0  # the fit's relative RMS error on them
    #: ``(shape, seconds)`` of controlled steps (a candidate forced) that an engine's
    #: online refits keep (``vllm_plugin.auto_choice``); cached with the model
    anchor: list[tuple[Shape, float]] = field(default_factory=list, repr=False)
    _num: float = field(default=0.0, repr=False, init=False)
    _den: float = field(default=0.0, repr=False, init=False)
    #: decayed sums over steps with drafts of 1, x, x*x, y, x*y (x: the fit's extra, y:
    #: the measured extra, uncorrected) for ``drafted_factor`` and ``drafted_offset``
    _drafted_sums: tuple[float, ...] = field(default=(0.0,) * 5, repr=False, init=False)

    def coefficients(self) -> dict[str, float]:
        """``{"a": ..., ..., "g": ...}``: the fitted coefficients (the engines' stats)."""
        return {k: getattr(self, k) for k in COEFFICIENTS}

    def raw(self, shape: Shape | Sequence[int]) -> float:
        """The fitted seconds of a step of ``shape``, uncorrected."""
        v, lv, r, br, dr, n = Shape(*shape)
        t = self.a + self.b * v + self.c * lv + self.d * r + self.e * br
        return t + self.f * dr + self.g * n

    def additive(self, parts: np.ndarray) -> np.ndarray:
        """The seconds of the parts of a step that add up over requests: ``parts[...,
        (verify_rows, draft_rows, branched)]`` -> ``b*v + d*r + e*br`` (``choose``)."""
        return self.b * parts[..., 0] + self.d * parts[..., 1] + self.e * parts[..., 2]

    def priced(self) -> CostModel:
        """This model with ``drafted_factor`` ``k`` and ``drafted_offset`` ``o`` folded into
        its coefficients (``b..e`` times ``k``, ``f`` to ``k * f + o``, ``g`` plus ``(1 -
        k) * b``): its ``raw`` is ``raw(plain_of(shape)) + k * (raw(shape) -
        raw(plain_of(shape))) + o`` for every shape with drafts (a plain step's rows are
        one per request) and ``raw(shape)`` for one without, what ``choose`` compares;
        ``self`` when ``k`` is 1 and ``o`` 0.

        >>> m = CostModel(a=0.05, b=0.002, c=0.003, d=0.0, f=0.001, drafted_factor=1.5,
        ...               drafted_offset=0.004)
        >>> s = Shape(12, 2, 8, 0, 1, 4)
        >>> p = m.plain_of(s)
        >>> want = m.raw(p) + 1.5 * (m.raw(s) - m.raw(p)) + 0.004
        >>> round(m.priced().raw(s), 9) == round(want, 9)
        True
        """
        k, o = self.drafted_factor, self._offset()
        if k == 1.0 and o == 0.0:
            return self
        scaled = {c: k * getattr(self, c) for c in "bcde"}
        return replace(
            self,
            **scaled,
            f=k * self.f + o,
            g=self.g + (1.0 - k) * self.b,
            drafted_factor=1.0,
            drafted_offset=0.0,
        )

    @staticmethod
    def plain_of(shape: Shape | Sequence[int]) -> Shape:
        """The step of ``shape``'s requests without drafts: one verify row each."""
        n = Shape(*shape).requests
        return Shape(n, 0, 0, 0, 0, n)

    def _split(self, shape: Shape) -> tuple[float, float]:
        """``(raw(plain_of(shape)), raw(shape) - raw(plain_of(shape)))``: the plain step
        of ``shape``'s requests, and what its drafts add (0 without drafts)."""
        raw = self.raw(shape)
        if not shape.drafted:
            return raw, 0.0
        plain = self.raw(self.plain_of(shape))
        return plain, raw - plain

    def _priced_split(self, shape: Shape) -> tuple[float, float, float]:
        """``(priced().raw(shape), plain, extra)``: ``raw(shape)`` with the drafts as
        ``drafted_factor`` and ``drafted_offset`` price them, and ``_split(shape)``."""
        plain, extra = self._split(shape)
        if not shape.drafted:
            return plain, plain, extra
        return plain + self.drafted_factor * extra + self._offset(), plain, extra

    def _offset_cap(self) -> float:
        """The most ``drafted_offset`` may be: ``drafted_offset_max`` plain steps of one
        request."""
        return max(self.drafted_offset_max * (self.a + self.b + self.g), 0.0)

    def _offset(self) -> float:
        """``drafted_offset`` within its cap now (the cap may have been lowered since)."""
        return min(self.drafted_offset, self._offset_cap())

    def predict(self, shape: Shape | Sequence[int]) -> float:
        """The predicted seconds of a step of ``shape`` (every correction)."""
        return self.correction * self._priced_split(Shape(*shape))[0]

    def observe(self, shape: Shape | Sequence[int], measured: float) -> None:
        """Correct online from one measured step of ``shape`` (seconds): ``correction``
        against the prediction with the drafts as priced (so it does not take in what
        only drafted steps get wrong), then, for a step with drafts, ``drafted_factor``
        and ``drafted_offset`` on its seconds over the corrected plain step."""
        shape = Shape(*shape)
        priced, plain, extra = self._priced_split(shape)
        if not (priced > 0 and math.isfinite(measured) and measured > 0):
            return
        k = self.correction_decay
        self._num, self._den = k * self._num + measured, k * self._den + priced
        lo, hi = self.bounds
        self.correction = min(hi, max(lo, self._num / self._den))
        if not shape.drafted or not self.learn_drafted:
            return
        x, y = extra, measured / self.correction - plain
        old = self._drafted_sums
        self._drafted_sums = sums = tuple(k * s + v for s, v in zip(old, (1.0, x, x * x, y, x * y)))
        self.drafted_factor, self.drafted_offset = self._drafted_fit(*sums)

    def _drafted_fit(
        self, s1: float, sx: float, sxx: float, sy: float, sxy: float
    ) -> tuple[float, float]:
        """``(drafted_factor, drafted_offset)`` from the decayed sums of ``observe``: least
        squares of ``y = k * x + o`` with a ridge pulling ``k`` to 1 (1% of the ``x * x``
        sum: where ``x`` hardly varies the offset takes the gap), then ``k``
        clipped to ``drafted_bounds`` and ``o`` to ``[0, _offset_cap()]``, each refitted to
        the data once the other is held at its bound."""
        lo, hi = self.drafted_bounds
        cap = self._offset_cap()
        varied = sxx > 1e-18 * max(s1, 1.0)  # else no step said what its drafts add
        if not varied:  # k stays
            k = min(hi, max(lo, self.drafted_factor))
        else:
            ridge = 0.01 * sxx
            det = (sxx + ridge) * s1 - sx * sx
            k = ((sxy + ridge) * s1 - sx * sy) / det if det > 0 else self.drafted_factor
            k = min(hi, max(lo, k))
        o = (sy - k * sx) / s1
        if not 0.0 <= o <= cap:
            o = min(cap, max(0.0, o))
            if varied:
                k = min(hi, max(lo, (sxy - o * sx) / sxx))
        return k, o

    @classmethod
    def fit(cls, samples: Sequence[tuple[Shape | Sequence[int], float]]) -> CostModel:
        """Least squares on ``(shape, seconds)`` samples with non-negative coefficients,
        on relative errors (each row weighted by ``1 / seconds``: small steps count as much
        as big ones)."""
        if not samples:
            raise ValueError("CostModel.fit: no samples")
        width = len(Shape._fields)  # a short tuple gets Shape's defaults
        rows = [s if len(s) == width else Shape(*s) for s, _ in samples]
        x = np.hstack([np.ones((len(rows), 1)), np.array(rows, dtype=float).reshape(-1, width)])
        y = np.array([float(t) for _, t in samples])
        if not np.all(np.isfinite(y) & (y > 0)):
            raise ValueError("CostModel.fit: every measured step must take > 0 seconds")
        coef = _nnls(x / y[:, None], np.ones_like(y))
        rel = (x @ coef - y) / y
        rms = float(np.sqrt(np.mean(rel * rel)))
        return cls(*map(float, coef), samples=len(samples), rel_rms=rms)

    def to_json(self) -> str:
        """The fitted coefficients as JSON (the online correction is per run: not kept)."""
        doc = {**self.coefficients(), "samples": self.samples, "rel_rms": self.rel_rms}
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> CostModel:
        """Inverse of ``to_json`` (a string or its parsed dict); ``ValueError`` when a
        coefficient (``a`` to ``e``; ``f`` and ``g`` may be left out: 0) is missing, not
        a finite number >= 0."""
        obj = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(obj, dict):
            raise ValueError("cost model JSON is not an object")
        coef = []
        for k in COEFFICIENTS:
            v = obj.get(k, 0.0 if k in "fg" else None)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"cost model coefficient {k}={v!r} is not a number >= 0")
            if not math.isfinite(v):
                raise ValueError(f"cost model coefficient {k}={v!r} is not finite")
            coef.append(float(v))
        return cls(*coef, samples=int(obj.get("samples", 0)), rel_rms=float(obj.get("rel_rms", 0)))


def default_shapes(
    verify_rows: Sequence[int] = (1, 16, 64),
    draft_levels: Sequence[int] = (0, 2, 6),
    draft_rows: Sequence[int] = (0, 8, 32),
) -> list[Shape]:
    """The grid ``measure`` times: every combination a step can have (no draft rows without
    draft levels and the reverse; at least one draft row per level). Unbranched, and
    ``drafted`` 0: the local engine's tree attention is the same for a chain and a tree,
    and a step with drafts runs the same path as one without."""
    return [
        Shape(v, lv, r)
        for v in verify_rows
        for lv in draft_levels
        for r in draft_rows
        if (lv == 0) == (r == 0) and r >= lv
    ]


def measure(
    run_step: Callable[[Shape], object],
    shapes: Sequence[Shape] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Time ``run_step(shape)`` (the engine's real verify + draft forwards of that size;
    it must synchronise the device before returning) ``repeats`` times per shape after
    ``warmup`` untimed calls, and fit a ``CostModel`` to the per-shape medians."""
    if repeats < 1:
        raise ValueError(f"measure: repeats must be >= 1, got {repeats}")
    samples = []
    for shape in shapes if shapes is not None else default_shapes():
        shape = Shape(*shape)
        for _ in range(warmup):
            run_step(shape)
        times = []
        for _ in range(repeats):
            t0 = clock()
            run_step(shape)
            times.append(clock() - t0)
        samples.append((shape, float(np.median(times))))
    return CostModel.fit(samples)


def machine_fingerprint(device: str | None = None) -> str:
    """What a timing depends on besides the model: the GPU's name (``device`` ``cuda...``)
    or the CPU's model, cores and torch's thread count."""
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        return f"gpu:{torch.cuda.get_device_name(dev)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"cpu:{cpu}:{os.cpu_count()} cores:{torch.get_num_threads()} threads"


def cache_key(model: str, dtype: object, device: str | None = None) -> dict[str, str]:
    """The cache key of a measured cost model: model name, machine, torch version, dtype."""
    return {
        "model": str(model),
        "machine": machine_fingerprint(device),
        "torch": str(torch.__version__),
        "dtype": str(dtype),
    }


_FORMAT = "treespec.auto.cost_model"
#: 2: the ``e`` term (branched trees); 3: the ``f`` and ``g`` terms (a step with drafts,
#: a request) and the anchor; a file of an older version is measured again
_VERSION = 3
#: Where the engines cache measured cost models: ``$TREESPEC_CACHE_DIR/auto``, else
#: ``~/.cache/treespec/auto``.
CACHE_ENV = "TREESPEC_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$TREESPEC_CACHE_DIR/auto``, else ``~/.cache/treespec/auto``."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "treespec"
    return Path(root) / "auto"


def cache_path(directory: str | os.PathLike, key: Mapping[str, str]) -> Path:
    """The cache file of ``key`` under ``directory`` (a hash of the key: one per key)."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()
    return Path(directory) / f"cost-model-{digest[:16]}.json"


def save_cost_model(directory: str | os.PathLike, key: Mapping[str, str], model: CostModel) -> Path:
    """Write ``model`` under ``key`` atomically (a temporary file in the same directory, then
    ``os.replace``): a reader sees the old file or the new one, never half of one."""
    path = cache_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": _FORMAT,
        "version": _VERSION,
        "key": dict(key),
        "model": json.loads(model.to_json()),
        "anchor": [[*map(int, s), float(t)] for s, t in model.anchor],
    }
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, sort_keys=True, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _anchor_of(rows: object) -> list[tuple[Shape, float]]:
    """A cache file's anchor rows ``[verify_rows, draft_levels, draft_rows, branched,
    drafted, requests, seconds]`` as ``(Shape, seconds)``; ``ValueError`` naming the first
    bad row."""
    if not isinstance(rows, list):
        raise ValueError(f"anchor is not a list: {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == len(Shape._fields) + 1
        counts = row[:-1] if ok else []
        ints = ok and all(type(v) is int and v >= 0 for v in counts)
        t = row[-1] if ok else None
        if not (ints and isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"anchor row {i} {row!r} is not 6 counts >= 0 and seconds > 0")
        out.append((Shape(*row[:-1]), float(t)))
    return out


def load_cost_model(directory: str | os.PathLike, key: Mapping[str, str]) -> CostModel | None:
    """The cached model of ``key``, or None: none cached, or (with a warning) a file that is
    not JSON, not ours, or of another key (another machine, model, torch or dtype). JSON
    only: nothing is unpickled."""
    path = cache_path(directory, key)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError("not a treespec cost-model file")
        if doc.get("version") != _VERSION:
            raise ValueError(f"format version {doc.get('version')!r}, not {_VERSION}")
        if doc.get("key") != dict(key):
            raise ValueError(f"its key {doc.get('key')!r} is not {dict(key)!r}")
        model = CostModel.from_json(doc["model"])
        model.anchor = _anchor_of(doc.get("anchor", []))
        return model
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        warnings.warn(f"ignoring the cost-model cache {path}: {e}", RuntimeWarning, stacklevel=2)
        return None


def load_or_measure(
    directory: str | os.PathLike,
    key: Mapping[str, str],
    run_step: Callable[[Shape], object],
    shapes: Sequence[Shape] | None = None,
    repeats: int = 5,
) -> CostModel:
    """The cached model of ``key``, else ``measure`` and cache it."""
    model = load_cost_model(directory, key)
    if model is None:
        model = measure(run_step, shapes, repeats)
        save_cost_model(directory, key, model)
    return model
