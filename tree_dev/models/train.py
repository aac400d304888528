"""Training of the tokenizer, target, small draft LM and EAGLE head (CPU, bf16 autocast).

With explicit step counts (``--target-steps/--draft-steps/--eagle-steps``) every
stage is deterministic for a seed (up to float reduction order).  With ``steps=None``
a stage runs for its share of the wall-clock budget and its learning-rate schedule
follows the elapsed time (so a shared, busy CPU still gets a full schedule); the
steps actually run are logged.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from . import data
from .eagle import EagleHead


@dataclass
class LMSpec:
    """Size of a ``LlamaForCausalLM`` (tied embeddings)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    def config(self, vocab_size: int, max_len: int, eos_id: int) -> LlamaConfig:
        cfg = LlamaConfig(
            vocab_size=vocab_size,
            max_position_embeddings=max_len,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            **asdict(self),
        )
        cfg._attn_implementation = "sdpa"
        return cfg


@dataclass
class Recipe:
    """Everything that defines a training run except the seed and the step counts."""

    vocab_size: int = 4096
    seq_len: int = 512
    target: LMSpec = field(default_factory=lambda: LMSpec(256, 6, 4, 2, 704))
    draft: LMSpec = field(default_factory=lambda: LMSpec(128, 2, 2, 1, 384))
    batch_size: int = 8
    lr: float = 2e-3
    draft_lr: float = 3e-3
    eagle_lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_windows: int = 16
    eagle_noise: float = 0.05  # uniform feature noise, as in EAGLE, for chained drafting
    share: tuple[float, float, float] = (0.7, 0.1, 0.2)  # target, draft, eagle time
    max_train_files: int | None = None


TINY = Recipe(
    vocab_size=320,
    seq_len=64,
    target=LMSpec(64, 2, 2, 1, 128),
    draft=LMSpec(32, 1, 1, 1, 64),
    batch_size=4,
    warmup=2,
    eval_every=10,
    eval_windows=2,
    max_train_files=40,
)


def lr_at(step: int, total: int, peak: float, warmup: int, progress: float | None = None) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% of ``peak``.

    The decay follows ``step / total``, or ``progress`` in [0, 1] (wall-clock mode).
    """
    t = (step - warmup) / max(1, total - warmup) if progress is None else progress
    w = min(1.0, (step + 1) / warmup)
    return w * peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, t)))))


class Logger:
    """Prints through tqdm and appends to a log file."""

    def __init__(self, path: Path | None):
        self.path = path

    def __call__(self, msg: str) -> None:
        tqdm.write(msg)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(msg + "\n")


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``model`` on windows ``x int64[B, T + 1]``."""
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())


@torch.no_grad()
def val_loss(model, windows: torch.Tensor, nbytes: torch.Tensor) -> tuple[float, float]:
    """``(nats per token, bits per byte)`` of ``model`` on ``windows int64[W, T + 1]``."""
    model.eval()
    tot, ntok, nb = 0.0, 0, 0
    for w in windows.split(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=w[:, :-1]).logits
        tot += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        ntok += w[:, 1:].numel()
        nb += int(nbytes[w[:, 1:]].sum())
    model.train()
    return float(tot) / ntok, float(tot) / (math.log(2) * nb)


def _optimizer(params, lr: float, wd: float) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def train_lm(
    model: LlamaForCausalLM,
    train_stream: torch.Tensor,
    val_windows: torch.Tensor,
    nbytes: torch.Tensor,
    recipe: Recipe,
    lr: float,
    seed: int,
    steps: int | None,
    budget_s: float,
    log: Logger,
    name: str,
) -> dict:
    """Train a causal LM on packed random windows; returns a history dict."""
    torch.manual_seed(seed)
    model.train()
    opt = _optimizer(model.parameters(), lr, recipe.weight_decay)
    it = data.batches(train_stream, recipe.seq_len, recipe.batch_size, seed)
    hist = {"step": [], "train_loss": [], "val_loss": [], "val_bpb": []}
    state = {"loss": float("nan"), "progress": None}

    def step_fn(i: int, total_guess: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(i, total_guess, lr, recipe.warmup, state["progress"])
        x = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["loss"] = float(loss.detach())

    t0 = time.perf_counter()
    timed = steps is None
    total = 10**9 if timed else steps
    bar = tqdm(_count(total), desc=name, total=None if timed else total, mininterval=5)
    for i in bar:
        state["progress"] = (time.perf_counter() - t0) / budget_s if timed else None
        if timed and state["progress"] >= 1.0:
            break
        step_fn(i, total)
        bar.set_postfix(loss=f"{state['loss']:.3f}", refresh=False)
        if (i + 1) % recipe.eval_every == 0:
            vl, bpb = val_loss(model, val_windows, nbytes)
            hist["step"].append(i + 1)
            hist["train_loss"].append(state["loss"])
            hist["val_loss"].append(vl)
            hist["val_bpb"].append(bpb)
            log(
                f"[{name}] step {i + 1} train {state['loss']:.4f} val {vl:.4f} "
                f"bpb {bpb:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"t {time.perf_counter() - t0:.0f}s"
            )
    done = i if timed else total
    if not hist["step"] or hist["step"][-1] != done:
        vl, bpb = val_loss(model, val_windows, nbytes)
        hist["step"].append(done)
        hist["train_loss"].append(state["loss"])
        hist["val_loss"].append(vl)
        hist["val_bpb"].append(bpb)
        log(f"[{name}] end at step {done}: val {vl:.4f} bpb {bpb:.4f}")
    hist["steps"] = done
    hist["seconds"] = time.perf_counter() - t0
    model.eval()
    return hist


def eagle_loss(
    head: EagleHead, target: LlamaForCausalLM, x: torch.Tensor, noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE loss on windows ``x int64[B, T + 1]`` -> ``(loss, top1 agreement)``.

    Features ``h = target.model(x).last_hidden_state``.  Head position ``i`` gets
    ``(x[i+1], h[i] + noise)`` and is trained to regress ``h[i+1]`` (smooth L1) and
    to match the target's next-token distribution at ``i+1`` (soft cross entropy).
    """
    with torch.no_grad():
        h = target.model(input_ids=x).last_hidden_state.float()
        tlogits = target.lm_head(h).float()
    hin = h[:, :-1]
    if noise:
        hin = hin + (torch.rand_like(hin) * 2 - 1) * noise
    pos = torch.arange(1, x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    out = head(x[:, 1:], hin, position_ids=pos)
    reg = F.smooth_l1_loss(out.hidden_states.float(), h[:, 1:])
    p = tlogits[:, 1:].softmax(-1)
    cls = -(p * out.logits.float().log_softmax(-1)).sum(-1).mean()
    agree = (out.logits.argmax(-1) == tlogits[:, 1:].argmax(-1)).float().mean()
    return reg + cls, agree


def train_eagle(
    head: EagleHead,
    target: LlamaForCausalLM,
    train_stream: torch.Tensor,
    val_windows: torch.Tensor,
    recipe: Recipe,
    seed: int,
    steps: int | None,
    budget_s: float,
    log: Logger,
) -> dict:
    """Train ``head`` on ``target``'s own features (target frozen)."""
    torch.manual_seed(seed)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    head.train()
    opt = _optimizer(head.parameters(), recipe.eagle_lr, recipe.weight_decay)
    it = data.batches(train_stream, recipe.seq_len, recipe.batch_size, seed + 1)
    hist = {"step": [], "train_loss": [], "val_agree": []}
    state = {"loss": float("nan"), "agree": float("nan"), "progress": None}

    def step_fn(i: int, total_guess: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(i, total_guess, recipe.eagle_lr, recipe.warmup, state["progress"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, agree = eagle_loss(head, target, next(it), recipe.eagle_noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["loss"], state["agree"] = float(loss.detach()), float(agree)

    def val() -> float:
        head.eval()
        acc = []
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for w in val_windows.split(4):
                acc.append(float(eagle_loss(head, target, w, 0.0)[1]))
        head.train()
        return sum(acc) / len(acc)

    t0 = time.perf_counter()
    timed = steps is None
    total = 10**9 if timed else steps
    bar = tqdm(_count(total), desc="eagle", total=None if timed else total, mininterval=5)
    for i in bar:
        state["progress"] = (time.perf_counter() - t0) / budget_s if timed else None
        if timed and state["progress"] >= 1.0:
            break
        step_fn(i, total)
        bar.set_postfix(loss=f"{state['loss']:.3f}", agree=f"{state['agree']:.3f}", refresh=False)
        if (i + 1) % recipe.eval_every == 0:
            va = val()
            hist["step"].append(i + 1)
            hist["train_loss"].append(state["loss"])
            hist["val_agree"].append(va)
            log(
                f"[eagle] step {i + 1} train {state['loss']:.4f} "
                f"train-agree {state['agree']:.3f} val-agree {va:.4f} "
                f"t {time.perf_counter() - t0:.0f}s"
            )
    done = i if timed else total
    if not hist["step"] or hist["step"][-1] != done:
        hist["step"].append(done)
        hist["train_loss"].append(state["loss"])
        hist["val_agree"].append(val())
        log(f"[eagle] end at step {done}: val-agree {hist['val_agree'][-1]:.4f}")
    hist["steps"] = done
    hist["seconds"] = time.perf_counter() - t0
    head.eval()
    return hist


def save_dir_atomic(out: Path, name: str, save_fn) -> None:
    """``save_fn(tmpdir)`` then move the directory to ``out / name`` (replacing it)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{name}-"))
    try:
        save_fn(tmp)
        dest = out / name
        if dest.exists():
            old = out / f".{name}-old"
            if old.exists():
                shutil.rmtree(old)
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def save_lm(model: LlamaForCausalLM, tokenizer, out: Path, name: str, dtype) -> None:
    """Save ``model`` with weights in ``dtype`` + ``tokenizer`` to ``out / name``.

    The in-memory fp32 parameters are rounded through ``dtype`` so that the model
    left in memory is exactly the stored one (buffers such as RoPE's ``inv_freq``
    are left in fp32, as a fresh load computes them).
    """
    import copy

    def fn(tmp: Path) -> None:
        copy.deepcopy(model).to(dtype).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))

    save_dir_atomic(out, name, fn)


def _count(n: int):
    """``range(n)`` without a length, so tqdm shows no bogus total in wall-clock mode."""
    yield from range(n)


def n_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _log_run(
    log: Logger,
    recipe: Recipe,
    *,
    command: str,
    seed: int,
    minutes: float,
    stages: tuple[str, ...],
    steps: dict[str, int | None],
) -> None:
    """The run's header lines: command, versions, settings and recipe."""
    import platform

    import transformers

    log(f"=== train {time.strftime('%Y-%m-%d %H:%M:%S %Z')} command: {command}")
    log(
        f"python {platform.python_version()} torch {torch.__version__} "
        f"transformers {transformers.__version__} threads {torch.get_num_threads()} "
        f"seed {seed} minutes {minutes} stages {stages} steps {steps}"
    )
    log(f"recipe {asdict(recipe)}")


def _read_corpus(recipe: Recipe, log: Logger) -> tuple[list[str], list[str]]:
    """Train and validation texts of the corpus (``max_train_files``: the first few)."""
    train_files, val_files = data.corpus_files()
    if recipe.max_train_files is not None:
        train_files = train_files[: recipe.max_train_files]
        val_files = val_files[: max(2, recipe.max_train_files // 10)]
    train_texts, val_texts = data.read_texts(train_files), data.read_texts(val_files)
    log(
        f"corpus {data.stdlib_root()}: train {len(train_texts)} files "
        f"{sum(len(t.encode()) for t in train_texts)} bytes, val {len(val_texts)} files "
        f"{sum(len(t.encode()) for t in val_texts)} bytes"
    )
    return train_texts, val_texts


@dataclass
class _Data:
    """The tokenizer and the tokens every stage trains and evaluates on."""

    tok: Any
    nbytes: torch.Tensor  # bytes per token id
    train_stream: torch.Tensor
    val_windows: torch.Tensor


def _prepare_data(
    out: Path, recipe: Recipe, stages: tuple[str, ...], log: Logger, wall0: float
) -> _Data:
    """Read the corpus, train the tokenizer (when asked or absent) and tokenize."""
    train_texts, val_texts = _read_corpus(recipe, log)
    tok_dir = out / "tokenizer"
    if "tokenizer" in stages or not (tok_dir / "tokenizer.json").is_file():
        tok = data.train_tokenizer(train_texts, recipe.vocab_size)
        save_dir_atomic(out, "tokenizer", tok.save_pretrained)
    tok = data.load_tokenizer(tok_dir)
    nbytes = data.token_byte_lengths(tok)
    train_stream = data.encode_stream(tok, train_texts)
    val_stream = data.encode_stream(tok, val_texts)
    val_windows = data.eval_windows(val_stream, recipe.seq_len, recipe.eval_windows)
    log(
        f"tokens: train {train_stream.numel()}, val {val_stream.numel()}; "
        f"bytes/token {nbytes[val_stream].sum().item() / val_stream.numel():.3f}; "
        f"prep {time.perf_counter() - wall0:.0f}s"
    )
    return _Data(tok, nbytes, train_stream, val_windows)


def _stage_seconds(
    recipe: Recipe, stages: tuple[str, ...], minutes: float, wall0: float
) -> dict[str, float]:
    """Each stage's share of the time left (at least 30 s in all) after data preparation."""
    budget = max(30.0, minutes * 60 - (time.perf_counter() - wall0))
    shares = dict(zip(("target", "draft", "eagle"), recipe.share))
    run_share = sum(shares[s] for s in stages if s in shares) or 1.0
    return {name: budget * share / run_share for name, share in shares.items()}


@dataclass
class _Run:
    """What every training stage of one ``run_train`` shares."""

    d: _Data
    recipe: Recipe
    seed: int
    log: Logger
    out: Path
    save_dtype: torch.dtype


def _train_lm_stage(
    run: _Run, name: str, max_steps: int | None, seconds: float
) -> tuple[LlamaForCausalLM, dict]:
    """Train and save the ``target`` or ``draft`` LM; returns it and its history."""
    d, recipe, seed, log, out = run.d, run.recipe, run.seed, run.log, run.out
    spec = recipe.target if name == "target" else recipe.draft
    torch.manual_seed(seed)
    model = LlamaForCausalLM(spec.config(len(d.tok), recipe.seq_len, d.tok.eos_token_id))
    log(f"[{name}] {n_params(model) / 1e6:.3f}M parameters {asdict(spec)}")
    hist = train_lm(
        model,
        d.train_stream,
        d.val_windows,
        d.nbytes,
        recipe,
        recipe.lr if name == "target" else recipe.draft_lr,
        seed,
        max_steps,
        seconds,
        log,
        name,
    )
    hist["params"] = n_params(model)
    save_lm(model, d.tok, out, name, run.save_dtype)
    return model, hist


def _train_eagle_stage(
    run: _Run,
    target: LlamaForCausalLM | None,
    max_steps: int | None,
    seconds: float,
    resume: bool,
) -> dict:
    """Train and save the EAGLE head on ``target`` (None: the one stored in ``out``);
    ``resume``: continue from ``out/eagle`` when it exists. Returns its history."""
    d, recipe, seed, log, out = run.d, run.recipe, run.seed, run.log, run.out
    if target is None:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(
            str(out / "target"), dtype=torch.float32, local_files_only=True
        )
    if resume and (out / "eagle" / "model.safetensors").is_file():
        head = EagleHead.from_pretrained(out / "eagle", target=target).train()
        log(f"[eagle] resuming from {out / 'eagle'}")
    else:
        head = EagleHead.from_target(target, seed=seed)
    head.target_path = "../target"
    head.float()
    own = sum(v.numel() for v in head.trainable_state_dict().values())
    log(f"[eagle] {own / 1e6:.3f}M own parameters (embedding and lm_head: the target's)")
    hist = train_eagle(
        head, target, d.train_stream, d.val_windows, recipe, seed, max_steps, seconds, log
    )
    hist["params"] = sum(v.numel() for v in head.trainable_state_dict().values())
    save_dir_atomic(out, "eagle", lambda p: head.save_pretrained(p, dtype=run.save_dtype))
    return hist


def _write_summary(
    out: Path, stages: tuple[str, ...], summary: dict, log: Logger, wall0: float
) -> None:
    """Log the run's end and write its summary (all three stages: ``train_summary.json``)."""
    import json

    from .eagle import _atomic_write

    summary["wall_seconds"] = time.perf_counter() - wall0
    log(
        f"=== done in {summary['wall_seconds']:.0f}s; steps "
        + ", ".join(f"{k}={v['steps']}" for k, v in summary["stages"].items())
    )
    name = (
        "train_summary.json"
        if set(stages) >= {"target", "draft", "eagle"}
        else (f"train_summary_{'_'.join(stages)}.json")
    )
    _atomic_write(out / name, json.dumps(summary, indent=1).encode())


def run_train(
    out: str | os.PathLike,
    minutes: float = 10.0,
    seed: int = 0,
    recipe: Recipe | None = None,
    steps: dict[str, int | None] | None = None,
    stages: tuple[str, ...] = ("target", "draft", "eagle"),
    save_dtype: torch.dtype = torch.bfloat16,
    command: str = "",
    threads: int = 2,
    resume: bool = False,
) -> dict:
    """Train tokenizer + the stages in ``stages`` into ``out``; returns a summary dict.

    Layout: ``out/{tokenizer,target,draft,eagle}``, ``out/train_log.txt`` and
    ``out/train_summary.json``.  Stages not listed are loaded from ``out``.  Weights
    are stored in ``save_dtype``; the EAGLE head is trained on the target *after* its
    round trip through ``save_dtype``, i.e. on exactly the stored target.  ``resume``:
    the EAGLE stage continues from ``out/eagle`` when it exists (new lr schedule).
    """
    recipe = recipe or Recipe()
    steps = steps or {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = Logger(out / "train_log.txt")
    torch.set_num_threads(threads)
    wall0 = time.perf_counter()
    _log_run(log, recipe, command=command, seed=seed, minutes=minutes, stages=stages, steps=steps)
    d = _prepare_data(out, recipe, stages, log, wall0)
    seconds = _stage_seconds(recipe, stages, minutes, wall0)
    summary: dict = {"seed": seed, "recipe": asdict(recipe), "command": command, "stages": {}}
    run = _Run(d, recipe, seed, log, out, save_dtype)
    models: dict[str, LlamaForCausalLM] = {}
    for name in ("target", "draft"):
        if name in stages:
            models[name], summary["stages"][name] = _train_lm_stage(
                run, name, steps.get(name), seconds[name]
            )
    if "eagle" in stages:
        summary["stages"]["eagle"] = _train_eagle_stage(
            run, models.get("target"), steps.get("eagle"), seconds["eagle"], resume
        )
    _write_summary(out, stages, summary, log, wall0)
    return summary
