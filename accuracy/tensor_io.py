"""On-disk format of tensor captures: atomic safetensors files plus JSON metadata.

Layout (one capture directory, as written by :class:`accuracy.CaptureWriter`)::

    capture_dir/
      manifest.json                       versions, dtypes, module list, config, git rev
      dp0/
        prefill_s128_0/
          model.layers.0/rank0.safetensors   one file per TP rank, key "tensor"
          prefill_s128_0_meta.json          written last: its presence marks completion
        decode_b1_0/ ...

Tensor-parallel ranks write the same pass directory: each rank its ``rank{r}`` files,
then (under an ``flock`` of the directory) its shapes merged into the metadata, so
``shapes[name]`` lists every rank that completed the pass and :func:`read` checks each
listed rank's file and shape.

Reading never unpickles: safetensors, or legacy ``rank{r}.pt`` via
``torch.load(weights_only=True)``. Every malformed input raises ``ValueError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: one writer per pass directory
    fcntl = None

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_FWD_DIR_RE = re.compile(r"^(prefill|decode)_([sb])(\d+)_(\d+)$")
_RANK_FILE_RE = re.compile(r"^rank(\d+)\.(safetensors|pt)$")
_TENSOR_KEY = "tensor"


@dataclass
class TreeMetadata:
    """Token-tree layout of the slots of one forward pass (tree verification).

    All lists are indexed by slot (token row of the captured tensors), requests
    concatenated in slot order. ``parents`` are request-local node indices
    (``-1`` for a root), as in ``tree_dev.tree``.

    Attributes:
        parents: int[T] parent node index within the request, -1 for the root.
        cu_nodes: int[R+1] slot offsets of each request's nodes; default one request.
        node_ids: int[T] request-local node id of each slot; default 0..n-1 per request.
        depths: int[T] node depth (root 0); derived from ``parents`` when omitted.
        positions: int[T] absolute token positions (``seq_len + depth``); optional.
        tokens: int[T] token id of each node; optional, used to pair with dense steps.
    """

    parents: list[int]
    cu_nodes: list[int] | None = None
    node_ids: list[int] | None = None
    depths: list[int] | None = None
    positions: list[int] | None = None
    tokens: list[int] | None = None

    def __post_init__(self) -> None:
        self.parents = [int(p) for p in _as_list(self.parents, "tree.parents")]
        n = len(self.parents)
        if self.cu_nodes is None:
            self.cu_nodes = [0, n]
        self.cu_nodes = [int(c) for c in _as_list(self.cu_nodes, "tree.cu_nodes")]
        cu = self.cu_nodes
        rising = all(b >= a for a, b in zip(cu[:-1], cu[1:], strict=True))
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or not rising:
            raise ValueError(f"tree.cu_nodes {cu} must rise from 0 to the node count {n}")
        if self.node_ids is None:
            self.node_ids = [i - cu[r] for r in range(len(cu) - 1) for i in range(cu[r], cu[r + 1])]
        for fname in ("node_ids", "depths", "positions", "tokens"):
            val = getattr(self, fname)
            if val is not None:
                val = [int(v) for v in _as_list(val, f"tree.{fname}")]
                if len(val) != n:
                    raise ValueError(f"tree.{fname} has {len(val)} entries, parents has {n}")
                setattr(self, fname, val)
        for r in range(len(cu) - 1):
            for s in range(cu[r], cu[r + 1]):
                p = self.parents[s]
                local = s - cu[r]
                if p == -1:
                    continue
                if not 0 <= p < local:
                    raise ValueError(
                        f"tree node {local} of request {r}: parent {p} must be -1 or an "
                        f"earlier node of the same request"
                    )
        derived = self._derive_depths()
        if self.depths is None:
            self.depths = derived
        elif self.depths != derived:
            bad = next(i for i, a in enumerate(self.depths) if a != derived[i])
            raise ValueError(
                f"tree.depths[{bad}]={self.depths[bad]} but parents give {derived[bad]}"
            )

    def _derive_depths(self) -> list[int]:
        depths = [0] * len(self.parents)
        for r in range(len(self.cu_nodes) - 1):
            base = self.cu_nodes[r]
            for s in range(base, self.cu_nodes[r + 1]):
                p = self.parents[s]
                depths[s] = 0 if p == -1 else depths[base + p] + 1
        return depths

    @property
    def num_requests(self) -> int:
        return len(self.cu_nodes) - 1

    def request_of(self, slot: int) -> int:
        for r in range(self.num_requests):
            if self.cu_nodes[r] <= slot < self.cu_nodes[r + 1]:
                return r
        raise ValueError(f"slot {slot} is outside the tree ({self.cu_nodes[-1]} nodes)")

    def path_slots(self, slot: int) -> list[int]:
        """Slots on the root-to-node path of ``slot`` (root first)."""
        base = self.cu_nodes[self.request_of(slot)]
        path = [slot]
        while self.parents[path[-1]] != -1:
            path.append(base + self.parents[path[-1]])
        return path[::-1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ForwardPassMetadata:
    """Scheduler metadata of one captured forward pass.

    Attributes:
        req_ids: request ids in batch order.
        positions: int[T] token position of every slot (padding included).
        dp_rank: data-parallel rank that ran the pass.
        token_ids: int[T] input token ids, optional (used for tree/dense pairing).
        padding_mask: bool[T], True marks a padded slot; None means infer from positions.
        tree: tree layout of the slots for a tree verification pass.
        modules: capture names in registration order.
        seq: global order of the pass within its writer (0, 1, ...).
        extra: free-form JSON-serialisable data from the caller.
        shapes: ``{name: {rank: [shape, dtype]}}`` as written (filled by :func:`write`).
    """

    req_ids: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    dp_rank: int = 0
    token_ids: list[int] | None = None
    padding_mask: list[bool] | None = None
    tree: TreeMetadata | None = None
    modules: list[str] = field(default_factory=list)
    seq: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict: top-level lists and dicts are copies, their
        contents shared (no deep copy: this runs once per captured pass)."""
        d = {f.name: _shallow(getattr(self, f.name)) for f in dataclasses.fields(self)}
        d["tree"] = self.tree.to_dict() if self.tree is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "metadata") -> ForwardPassMetadata:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        for key in ("req_ids", "positions"):
            if key not in d:
                raise ValueError(f"{where}: missing field '{key}'")
        if not isinstance(d["req_ids"], list) or not isinstance(d["positions"], list):
            raise ValueError(f"{where}: req_ids and positions must be lists")
        if not all(isinstance(p, int) for p in d["positions"]):
            raise ValueError(f"{where}: positions must be integers")
        tree = d.get("tree")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        try:
            kwargs["tree"] = TreeMetadata(**tree) if tree else None
        except TypeError as e:
            raise ValueError(f"{where}: bad tree metadata ({e})") from e
        return cls(**kwargs)


@dataclass
class CapturedForwardPass:
    """One forward pass: ``tensors[name][tp_rank] -> Tensor`` plus its metadata.

    ``dir_name`` is ``{phase}_{s|b}{size}_{counter}`` (``s`` = prefill sequence
    bucket, ``b`` = decode batch bucket).
    """

    dir_name: str
    metadata: ForwardPassMetadata
    tensors: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def phase(self) -> str:
        return parse_dir_name(self.dir_name)[0]

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def bucket(self) -> int:
        return parse_dir_name(self.dir_name)[1]

    @property
    def counter(self) -> int:
        return parse_dir_name(self.dir_name)[2]

    @property
    def module_names(self) -> list[str]:
        order = [m for m in self.metadata.modules if m in self.tensors]
        return order + [m for m in self.tensors if m not in order]

    def rank_tensors(self, name: str) -> list[torch.Tensor]:
        """Tensors of capture ``name`` sorted by TP rank."""
        ranks = self.tensors[name]
        return [ranks[r] for r in sorted(ranks)]


def parse_dir_name(dir_name: str) -> tuple[str, int, int]:
    """``"decode_b4_2"`` -> ``("decode", 4, 2)``; ValueError for anything else."""
    m = _FWD_DIR_RE.match(dir_name)
    if not m or (m.group(1) == "prefill") != (m.group(2) == "s"):
        raise ValueError(
            f"'{dir_name}' is not a forward-pass directory name (prefill_s<N>_<k> or "
            f"decode_b<N>_<k>)"
        )
    return m.group(1), int(m.group(3)), int(m.group(4))


def check_capture_name(name: str) -> str:
    """Capture names become directory names: reject separators and dot-only names."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or ("\\" in name or "\x00" in name)
    ):
        raise ValueError(f"invalid capture name {name!r}: it becomes a directory name")
    return name


# ----------------------------------------------------------------------------- writing


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same directory + os.replace.

    The temp name carries the process and thread id (one writer per name at a time) and
    is created ``O_EXCL`` with mode 0666 less the umask (the mode of a plain ``open``);
    the directory is created only when missing. A failure removes the temp file and
    raises ``OSError`` naming ``path``.
    """
    import threading

    d, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".tmp-{os.getpid()}-{threading.get_ident()}-{base}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:
            os.makedirs(d, exist_ok=True)
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:  # a stale temp file of a killed writer with this pid
            os.unlink(tmp)
            fd = os.open(tmp, flags, 0o666)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
        raise


def atomic_write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    """Atomic JSON file; ``indent=None`` writes one compact line (the C encoder: the
    per-pass metadata, written once per forward)."""
    text = json.dumps(obj, indent=indent, sort_keys=False)
    atomic_write_bytes(path, (text + "\n").encode())


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_BY_NAME = {str(d).replace("torch.", ""): d for d in _SAFETENSORS_DTYPES}
_AS_NUMPY = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: its bits as int16


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (a CPU copy where it lives elsewhere), row-major, any
    shape (0-d and empty included); no copy for a contiguous CPU tensor."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype in _AS_NUMPY:
        t = t.view(_AS_NUMPY[t.dtype])
    return memoryview(t.numpy().reshape(-1).view("u1"))


def tensor_from_bytes(buf: memoryview | bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`tensor_bytes`: a tensor of ``dtype`` (its torch name, e.g.
    ``"bfloat16"``) and ``shape`` over a copy of ``buf``; ValueError naming a dtype
    outside the common ones."""
    dt = _DTYPE_BY_NAME.get(dtype)
    if dt is None:
        raise ValueError(f"capture frame: unknown dtype {dtype!r}")
    if len(buf) == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dt).reshape(shape)


def safetensors_bytes(tensor: torch.Tensor, metadata: dict[str, str] | None = None) -> bytes:
    """One tensor (key ``"tensor"``) in the safetensors format, encoded directly: an
    8-byte little-endian header length, the JSON header padded with spaces to 8 bytes,
    the raw data. ``safetensors``' own loaders read it; dtypes outside the format's
    common ones go through the library."""
    code = _SAFETENSORS_DTYPES.get(tensor.dtype)
    if code is None:
        from safetensors.torch import save

        t = tensor.detach().cpu().contiguous()
        return save({_TENSOR_KEY: t}, metadata=metadata)
    data = tensor_bytes(tensor)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    header[_TENSOR_KEY] = {
        "dtype": code,
        "shape": list(tensor.shape),
        "data_offsets": [0, len(data)],
    }
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return b"".join((len(h).to_bytes(8, "little"), h, data))


def save_tensor_file(path: str, tensor: torch.Tensor, metadata: dict[str, str] | None = None):
    """Atomically write one tensor as safetensors (key ``"tensor"``)."""
    atomic_write_bytes(path, safetensors_bytes(tensor, metadata))


def write(
    capture_dir: str,
    forward_passes: Iterable[CapturedForwardPass],
    manifest: dict[str, Any] | None = None,
) -> None:
    """Write forward passes under ``capture_dir`` (tensors first, metadata JSON last).

    Each file is written atomically; a forward-pass directory without its
    ``{dir_name}_meta.json`` is incomplete and :func:`read` rejects it.
    """
    if manifest is not None:
        os.makedirs(capture_dir, exist_ok=True)
    for fwd in forward_passes:
        parse_dir_name(fwd.dir_name)
        fdir = os.path.join(capture_dir, fwd.dir_name)
        names = []
        for name, ranks in fwd.tensors.items():
            check_capture_name(name)
            names.append(name)
            for rank, tensor in ranks.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"capture '{name}' rank {rank}: not a tensor")
        meta = fwd.metadata.to_dict()
        if not meta["modules"]:
            meta["modules"] = names
        meta["dir_name"] = fwd.dir_name
        meta["format_version"] = FORMAT_VERSION
        meta["shapes"] = {
            n: {str(r): [list(t.shape), str(t.dtype).replace("torch.", "")] for r, t in rk.items()}
            for n, rk in fwd.tensors.items()
        }
        path = os.path.join(fdir, f"{fwd.dir_name}_meta.json")
        if os.path.isfile(path):  # another TP rank's pass: refuse a mismatch before writing
            _merge_rank_meta(_read_meta(fdir, fwd.dir_name), meta, path)
        for name, ranks in fwd.tensors.items():
            mdir = os.path.join(fdir, name)
            for rank, tensor in ranks.items():
                fpath = os.path.join(mdir, f"rank{int(rank)}.safetensors")
                try:  # one mkdir per module directory, then one open per file
                    os.makedirs(mdir, exist_ok=True)
                except OSError as e:
                    raise OSError(e.errno, f"cannot write {fpath}: {e.strerror or e}") from e
                save_tensor_file(
                    fpath,
                    tensor,
                    {"name": name, "rank": str(int(rank))},
                )
        os.makedirs(fdir, exist_ok=True)
        with _dir_lock(fdir):  # TP ranks write the same pass: merge, never overwrite
            if os.path.isfile(path):  # another rank's metadata is merged; this rank's replaced
                meta = _merge_rank_meta(_read_meta(fdir, fwd.dir_name), meta, path)
            atomic_write_json(path, meta, indent=None)
    if manifest is not None:
        atomic_write_json(os.path.join(capture_dir, MANIFEST_NAME), manifest)


@contextlib.contextmanager
def _dir_lock(path: str) -> Iterator[None]:
    """Exclusive ``flock`` on the directory ``path`` (no lock file left behind): the
    tensor-parallel ranks of one process group write the same pass's metadata."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _merge_rank_meta(old: dict[str, Any], new: dict[str, Any], where: str) -> dict[str, Any]:
    """Metadata of a pass another TP rank already wrote, with ``new``'s ranks added.

    ``shapes`` becomes the union ``{name: {rank: [shape, dtype]}}`` over ranks; module
    order is the first writer's, then new names. Every rank runs the same scheduler step,
    so positions and request ids must agree; a mismatch (a stale directory of another
    run) raises ValueError naming the field. When ``old`` already holds one of ``new``'s
    ranks (the same rank writing the pass again) ``new`` replaces it, as without TP.
    """
    mine = {r for ranks in new["shapes"].values() for r in ranks}
    if any(mine & set(r) for r in (old.get("shapes") or {}).values()):
        return new
    for key in ("req_ids", "positions", "dp_rank"):
        if old.get(key) != new.get(key):
            raise ValueError(
                f"{where}: another rank wrote {key}={old.get(key)!r}, this rank "
                f"{new.get(key)!r} (a stale capture directory?)"
            )
    out = dict(new)
    shapes = {n: dict(r) for n, r in (old.get("shapes") or {}).items()}
    for n, ranks in new["shapes"].items():
        shapes.setdefault(n, {}).update(ranks)
    out["shapes"] = {
        n: dict(sorted(r.items(), key=lambda kv: int(kv[0]))) for n, r in shapes.items()
    }
    mods = list(old.get("modules") or [])
    out["modules"] = mods + [m for m in new.get("modules") or [] if m not in mods]
    return out


# ----------------------------------------------------------------------------- reading


def load_tensor_file(path: str) -> torch.Tensor:
    """Load one rank file (safetensors, or legacy .pt with weights_only=True)."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            d = load_file(path)
            if _TENSOR_KEY in d:
                return d[_TENSOR_KEY]
            if len(d) == 1:
                return next(iter(d.values()))
            raise ValueError(f"{path}: expected one tensor, found keys {sorted(d)}")
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except ValueError:
        raise
    except Exception as e:  # safetensors/torch raise their own types for corrupt files
        raise ValueError(f"{path}: corrupted or truncated tensor file ({e})") from e
    if isinstance(obj, torch.Tensor):
        return obj
    if (
        isinstance(obj, dict)
        and len(obj) == 1
        and isinstance(next(iter(obj.values())), torch.Tensor)
    ):
        return next(iter(obj.values()))
    raise ValueError(f"{path}: legacy .pt file does not hold a single tensor")


def _read_meta(fdir: str, dir_name: str) -> dict[str, Any]:
    path = os.path.join(fdir, f"{dir_name}_meta.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{fdir}: missing metadata file {dir_name}_meta.json (incomplete capture?)"
        )
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable metadata ({e})") from e


def list_forward_dirs(capture_dir: str) -> list[tuple[int, str]]:
    """``(dp_rank, path)`` of every forward-pass directory under ``capture_dir``.

    Accepts a capture directory holding ``dp{N}/`` subdirectories, or a ``dp{N}``
    directory itself. Sibling ``draft/`` and ``vision/`` trees are separate captures.
    """
    if not os.path.isdir(capture_dir):
        raise ValueError(f"{capture_dir}: not a directory")
    out = []
    dp_dirs = sorted(
        (int(e[2:]), os.path.join(capture_dir, e))
        for e in os.listdir(capture_dir)
        if re.fullmatch(r"dp\d+", e) and os.path.isdir(os.path.join(capture_dir, e))
    )
    if not dp_dirs:
        m = re.fullmatch(r"dp(\d+)", os.path.basename(os.path.normpath(capture_dir)))
        dp_dirs = [(int(m.group(1)) if m else 0, capture_dir)]
    for dp, d in dp_dirs:
        for e in sorted(os.listdir(d)):
            if _FWD_DIR_RE.match(e) and os.path.isdir(os.path.join(d, e)):
                out.append((dp, os.path.join(d, e)))
    return out


def read(capture_dir: str, load_tensors: bool = True) -> list[CapturedForwardPass]:
    """Read every forward pass under ``capture_dir``, ordered by (dp rank, write order).

    Args:
        capture_dir: directory given to the writer (holding ``dp{N}/``) or a ``dp{N}`` dir.
        load_tensors: False reads metadata and shapes only (``tensors`` stays empty).
    Returns:
        list of :class:`CapturedForwardPass`.
    Raises:
        ValueError: no captures, missing metadata, corrupted or truncated files.
    """
    dirs = list_forward_dirs(capture_dir)
    if not dirs:
        raise ValueError(f"{capture_dir}: no forward-pass directories (prefill_s*/decode_b*)")
    passes = []
    for dp, fdir in dirs:
        dir_name = os.path.basename(fdir)
        meta_d = _read_meta(fdir, dir_name)
        meta = ForwardPassMetadata.from_dict(meta_d, where=f"{fdir} metadata")
        fwd = CapturedForwardPass(dir_name=dir_name, metadata=meta)
        if load_tensors:
            for name in sorted(os.listdir(fdir)):
                mdir = os.path.join(fdir, name)
                if not os.path.isdir(mdir):
                    continue
                ranks = {}
                for fname in os.listdir(mdir):
                    m = _RANK_FILE_RE.match(fname)
                    if m:
                        r = int(m.group(1))
                        if r in ranks and fname.endswith(".pt"):
                            continue  # prefer the safetensors file of the same rank
                        ranks[r] = load_tensor_file(os.path.join(mdir, fname))
                if ranks:
                    fwd.tensors[name] = dict(sorted(ranks.items()))
            missing = [m for m in meta.modules if m not in fwd.tensors]
            if missing:
                raise ValueError(f"{fdir}: metadata lists modules with no tensor files: {missing}")
            _check_rank_shapes(fdir, meta.shapes, fwd.tensors)
        passes.append((dp, meta.seq, fwd.counter, fwd))
    passes.sort(key=lambda x: (x[0], x[1], x[2]))
    return [p[-1] for p in passes]


def _check_rank_shapes(
    fdir: str, shapes: dict[str, Any], tensors: dict[str, dict[int, torch.Tensor]]
) -> None:
    """Every rank the metadata lists has its file, of the recorded shape (ValueError)."""
    for name, ranks in (shapes or {}).items():
        for r, rec in ranks.items():
            t = tensors.get(name, {}).get(int(r))
            if t is None:
                raise ValueError(f"{fdir}: metadata lists '{name}' rank {r} but it has no file")
            if isinstance(rec, list) and rec and list(t.shape) != list(rec[0]):
                raise ValueError(
                    f"{fdir}: '{name}' rank {r} has shape {list(t.shape)}, metadata {rec[0]}"
                )


def read_manifest(capture_dir: str) -> dict[str, Any] | None:
    path = os.path.join(capture_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable manifest ({e})") from e


def _shallow(v: Any) -> Any:
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    return v


def _as_list(v: Any, what: str) -> list:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().reshape(-1).tolist()
    if isinstance(v, (list, tuple)):
        return list(v)
    raise ValueError(f"{what}: expected a list or tensor, got {type(v).__name__}")
