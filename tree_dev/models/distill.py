"""A self-distilled EAGLE head for a pretrained target, trained on this CPU.

``python -m tree_dev.models distill-eagle --model smollm2-135m --out DIR`` runs four
stages; each writes its result atomically under ``--work`` and a rerun skips the
stages whose file is there:

1. **answers** (``answers.safetensors``): the target answers ``--prompts`` training
   prompts (``distill_prompts``: templated chat questions, standard-library code
   openings; none held out) through vLLM plain decoding when vLLM imports, else
   ``transformers`` ``generate``. Half greedy, half at ``--temperature``, so the head
   learns both the argmax path and the sampled one.
2. **features** (``features.safetensors``): one target forward over every prompt +
   answer gives the feature the head consumes (the final-norm output, see
   ``eagle.py``), fp16, and the target's argmax at each position.
3. **train**: the head (``EagleHead.from_target``) regresses ``h[i+1]`` (smooth L1) and
   learns the target's argmax with a cross entropy over a *reduced vocabulary*: the
   ``--vocab`` tokens most frequent among the labels (EAGLE-3 drafts over a reduced
   vocabulary too). The full 49152-row ``lm_head`` would cost four times the rest of a
   training step here. The head then drafts over that vocabulary alone
   (``EagleHead.restrict_vocab``: the target's ``lm_head`` rows of those tokens, six
   times fewer than the full head's, and no untrained logit can win). Noise on the
   input feature (EAGLE's recipe) makes it robust to its own chained features.
4. **eval**: on the held-out prompts (``prompts.py``) the target's greedy answers, then
   the head chained along them: top-1 agreement at depth 1 and the expected accepted
   length of a greedy chain of 4 (``tau_chain4``, tokens per target forward).

The head is written with ``EagleHead.save_pretrained`` (bf16 weights, its target named
``named:MODEL`` so that it loads from the model cache wherever the repository is).

    python -m tree_dev.models distill-eagle --model smollm2-135m \\
        --out checkpoints/smollm2-135m-eagle --prompts 1200 --minutes 20
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from .distill_prompts import training_texts
from .eagle import EagleHead, _atomic_write, save_safetensors_atomic
from .prompts import heldout_prompt_ids


def load_cached(path: Path, expect: dict) -> dict[str, torch.Tensor] | None:
    """The tensors of a stage's cached file, or None when there is none. A file written
    for other settings (its metadata differs from ``expect``) is a ``ValueError`` naming
    the file and the setting, so a rerun never trains on data it did not ask for."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    for key, want in expect.items():
        if meta.get(key) != str(want):
            raise ValueError(
                f"{path}: cached for {key}={meta.get(key)}, this run asks {key}={want}; "
                "remove it or give another --work"
            )
    return load_file(str(path))


def _ragged(seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Sequences packed as ``ids int32[N]`` and ``offsets int64[S + 1]``."""
    lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    flat = [t for s in seqs for t in s]
    return {"ids": torch.tensor(flat, dtype=torch.int32), "offsets": lens.cumsum(0)}


def _unragged(ids: torch.Tensor, offsets: torch.Tensor) -> list[list[int]]:
    o = offsets.tolist()
    return [ids[o[i] : o[i + 1]].tolist() for i in range(len(o) - 1)]


def prompt_ids(tokenizer, texts: list[tuple[str, str]]) -> list[list[int]]:
    """Token ids of ``(kind, text)`` prompts; chat ones through the chat template."""
    out = []
    for kind, text in texts:
        if kind == "chat":
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out.append(list(ids))
        else:
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def generate_answers(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    """The target's answers (vLLM plain decoding): even prompts greedy, odd ones sampled
    at ``temperature``."""
    from vllm import LLM, SamplingParams, TokensPrompt

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=64,
        seed=seed,
    )
    try:
        params = [
            SamplingParams(
                temperature=0.0 if i % 2 == 0 else temperature,
                max_tokens=max_tokens,
                seed=seed + i,
            )
            for i in range(len(prompts))
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        from tree_dev.testing import shutdown_engine

        shutdown_engine(llm)


@torch.no_grad()
def target_features(
    target, seqs: list[list[int]], max_tokens_per_batch: int = 4096
) -> dict[str, torch.Tensor]:
    """One target forward per batch of sequences (right-padded, causal): the final-norm
    feature of every position (``features float16[N, hidden]``) and the target's argmax
    there (``argmax int32[N]``), in the order of the packed ``ids``."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    arg: list[torch.Tensor | None] = [None] * len(seqs)
    batch: list[int] = []
    bar = tqdm(total=sum(len(s) for s in seqs), desc="features", unit="tok", mininterval=5)

    def run(idx: list[int]) -> None:
        width = max(len(seqs[i]) for i in idx)
        x = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        h = target.model(input_ids=x, attention_mask=mask).last_hidden_state
        a = target.lm_head(h).argmax(-1)
        for r, i in enumerate(idx):
            n = len(seqs[i])
            feats[i] = h[r, :n].to(torch.float16)
            arg[i] = a[r, :n].to(torch.int32)
            bar.update(n)

    for i in order:
        if batch and (len(batch) + 1) * len(seqs[i]) > max_tokens_per_batch:
            run(batch)
            batch = []
        batch.append(i)
    if batch:
        run(batch)
    bar.close()
    return {"features": torch.cat(feats), "argmax": torch.cat(arg)}


def reduced_vocab(labels: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` most frequent ``labels`` plus ``always`` (e.g. end-of-sequence
    tokens), sorted: ``int64[<= size + len(always)]``."""
    counts = torch.bincount(labels.long())
    top = counts.argsort(descending=True)[:size]
    top = top[counts[top] > 0]
    return torch.unique(torch.cat([top, torch.tensor(always, dtype=torch.long)]))


def _windows(offsets: list[int], length: int) -> list[tuple[int, int]]:
    """``(start, end)`` spans of at most ``length + 1`` positions inside each sequence."""
    out = []
    for s, e in zip(offsets[:-1], offsets[1:]):
        for a in range(s, e - 1, length):
            b = min(a + length + 1, e)
            if b - a >= 2:
                out.append((a, b))
    return out


def _batch(data: dict, picked: list[tuple[int, int]], remap: torch.Tensor) -> tuple:
    """Windows ``picked`` of the packed data, right-padded: ``(x, h, y, valid)``."""
    ids, feats, arg = data["ids"], data["features"], data["argmax"]
    width = max(b - a for a, b in picked)
    x = torch.zeros(len(picked), width, dtype=torch.long)
    h = torch.zeros(len(picked), width, feats.shape[1])
    y = torch.full((len(picked), width), -100, dtype=torch.long)
    valid = torch.zeros(len(picked), width, dtype=torch.bool)
    for r, (a, b) in enumerate(picked):
        x[r, : b - a] = ids[a:b].long()
        h[r, : b - a] = feats[a:b].float()
        y[r, : b - a] = remap[arg[a:b].long()]
        valid[r, : b - a] = True
    return x, h, y, valid


def _passes(head: EagleHead, x, h, valid, noise: float, unroll: int) -> list[torch.Tensor]:
    """The head's outputs ``g`` of ``1 + unroll`` passes over a batch. Pass 1 reads the
    target's features (plus uniform ``noise``); pass ``k + 1`` reads, at head position
    ``j``, pass ``k``'s output at ``j - 1`` (the head's own stand-in for ``h[j]``), as
    a chained draft does at depth ``k + 1``. ``g[k][:, j]`` regresses ``h[:, j + 1]``."""
    B, W = x.shape
    emb = head.embed(x[:, 1:])
    pos = torch.arange(1, W)[None].expand(B, -1)
    mask = valid[:, 1:].long()
    feat = h[:, :-1]
    if noise:
        feat = feat + (torch.rand_like(feat) * 2 - 1) * noise
    outs = []
    for _ in range(1 + unroll):
        z = head.fc(torch.cat([emb, feat], -1))
        g = head.decoder(inputs_embeds=z, position_ids=pos, attention_mask=mask).last_hidden_state
        outs.append(g)
        # the next pass: position j reads this pass's g at j - 1 (position 0 keeps h[0])
        feat = torch.cat([feat[:, :1], g[:, :-1]], 1)
    return outs


def train_head(
    head: EagleHead,
    data: dict[str, torch.Tensor],
    vocab: torch.Tensor,
    minutes: float,
    seq_len: int = 128,
    batch: int = 16,
    lr: float = 1e-3,
    noise: float = 0.1,
    unroll: int = 1,
    weight_decay: float = 0.05,
    val_share: float = 0.05,
    eval_every: int = 100,
    seed: int = 0,
) -> dict:
    """Train ``head`` for ``minutes`` on cached ``data`` (``ids``, ``offsets``,
    ``features``, ``argmax``).

    Loss of each pass (``_passes``: the target's features, then ``unroll`` passes on the
    head's own): smooth L1 of ``g[:, j]`` to ``h[:, j + 1]`` plus cross entropy of the
    target's argmax at ``j + 1`` over ``vocab`` (labels outside it ignored). Cosine
    learning rate over the time budget. ``val_share`` of the sequences are held out: every
    ``eval_every`` steps the head's agreement on them (each pass's argmax against the
    target's) is measured, and the head ends with the weights of the best measurement,
    so that a small data set is not memorised. Returns the history."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    offsets = data["offsets"].tolist()
    seqs = list(range(len(offsets) - 1))
    val_seqs = set(rng.sample(seqs, max(1, int(len(seqs) * val_share))))
    spans = _windows(offsets, seq_len)
    seq_of = [bisect.bisect_right(offsets, a) - 1 for a, _ in spans]  # a window's sequence
    train_spans = [sp for sp, i in zip(spans, seq_of) if i not in val_seqs]
    val_spans = [sp for sp, i in zip(spans, seq_of) if i in val_seqs][:256]
    remap = torch.full((head.config.vocab_size,), -100, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    w_small = head.lm_head.weight.detach()[vocab].float()
    params = [
        p
        for n, p in head.named_parameters()
        if n.startswith(("fc.", "decoder.layers", "decoder.norm"))
    ]
    for p in head.decoder.embed_tokens.parameters():
        p.requires_grad_(False)
    for p in head.lm_head.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))

    def losses(x, h, y, valid, noise_now):
        outs = _passes(head, x, h, valid, noise_now, unroll)
        total, agrees = 0.0, []
        for k, g in enumerate(outs):
            m = valid[:, 1:].clone()
            m[:, :k] = False  # pass k + 1 starts at head position k
            reg = F.smooth_l1_loss(g[m], h[:, 1:][m])
            logits = g @ w_small.T
            labels = y[:, 1:].masked_fill(~m, -100)
            total = (
                total
                + reg
                + 0.5 * F.cross_entropy(logits.reshape(-1, len(vocab)), labels.reshape(-1))
            )
            ok = labels != -100
            agrees.append(float((logits.argmax(-1)[ok] == labels[ok]).float().mean()))
        return total, agrees

    def validate() -> list[float]:
        head.eval()
        with torch.no_grad():
            sums = None
            for i in range(0, len(val_spans), 32):
                _, a = losses(*_batch(data, val_spans[i : i + 32], remap), 0.0)
                sums = a if sums is None else [s + v for s, v in zip(sums, a)]
            n = (len(val_spans) + 31) // 32
        head.train()
        return [s / n for s in sums]

    head.train()
    t0 = time.perf_counter()
    budget = minutes * 60
    hist: dict[str, list] = {
        "step": [],
        "loss": [],
        "train_agree": [],
        "val_agree": [],
        "seconds": [],
    }
    best = (-1.0, None, 0)
    bar = tqdm(desc="train", unit="step", mininterval=5)
    step = 0
    while (elapsed := time.perf_counter() - t0) < budget:
        frac = elapsed / budget
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        picked = [train_spans[rng.randrange(len(train_spans))] for _ in range(batch)]
        loss, agrees = losses(*_batch(data, picked, remap), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        if step % eval_every == 0:
            val = validate()
            score = sum(val)
            if score > best[0]:
                best = (
                    score,
                    {k: v.detach().clone() for k, v in head.trainable_state_dict().items()},
                    step,
                )
            hist["step"].append(step)
            hist["loss"].append(float(loss.detach()))
            hist["train_agree"].append(agrees)
            hist["val_agree"].append(val)
            hist["seconds"].append(elapsed)
            bar.set_postfix(
                loss=f"{float(loss.detach()):.3f}", val=[round(v, 3) for v in val], refresh=False
            )
    bar.close()
    if best[1] is not None:
        head.load_state_dict(best[1], strict=False)
    head.eval()
    hist["steps"] = step
    hist["best_step"] = best[2]
    return hist


@torch.no_grad()
def chain_acceptance(
    head: EagleHead, target, prompts: list[list[int]], answers: list[list[int]], depth: int = 4
) -> dict:
    """Greedy chain acceptance of ``head`` along the target's greedy ``answers``.

    At every answer position ``t`` (the target has just produced ``x_t``) the head drafts
    ``depth`` tokens: the first from ``(x_t, h_{t-1})``, the next ones from its own token
    and feature; a draft counts while it equals the target's answer. Returns
    ``positions``, ``agree1`` (depth-1 acceptance), ``accept_per_depth`` and
    ``tau_chain{depth}`` (1 + mean accepted length: tokens per target forward)."""
    accepted = [0] * depth
    n = 0
    for p, a in zip(prompts, answers):
        seq = p + a
        x = torch.tensor([seq])
        h = target.model(input_ids=x).last_hidden_state
        L = len(seq)
        full = head(x[:, 1:], h[:, :-1], position_ids=torch.arange(1, L)[None], use_cache=True)
        for t in range(len(p), L - 1):
            n += 1
            tok = int(full.logits[0, t - 1].argmax())  # head position t predicts x_{t+1}
            if tok != seq[t + 1]:
                continue
            accepted[0] += 1
            cache = copy.deepcopy(full.past_key_values)
            cache.crop(t - (L - 1))  # drop head positions t+1..L-1, keep 1..t
            g = full.hidden_states[0, t - 1]
            for k in range(1, depth):
                if t + 1 + k >= L:
                    break
                o = head(
                    torch.tensor([[tok]]),
                    g[None, None],
                    position_ids=torch.tensor([[t + k]]),
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, g = o.past_key_values, o.hidden_states[0, -1]
                tok = int(o.logits[0, -1].argmax())
                if tok != seq[t + 1 + k]:
                    break
                accepted[k] += 1
    per = [c / max(n, 1) for c in accepted]
    return {
        "positions": n,
        "agree1": per[0],
        "accept_per_depth": per,
        f"tau_chain{depth}": 1 + sum(per),
    }


def target_reference(model: str, model_dir: Path) -> str:
    """How the head names its target: ``named:NAME`` for a model of ``NAMED_MODELS``
    (found in the model cache anywhere), else the target directory's absolute path (a
    relative one would be read relative to the head's directory)."""
    from .named import is_named

    return f"named:{model}" if is_named(model) else str(Path(model_dir).resolve())


def run_distill(
    model: str,
    out: str | os.PathLike,
    work: str | os.PathLike | None = None,
    n_prompts: int = 1024,
    max_tokens: int = 160,
    temperature: float = 0.8,
    vocab_size: int = 8192,
    minutes: float = 20.0,
    eval_prompts: int = 16,
    eval_tokens: int = 64,
    seed: int = 0,
    threads: int = 2,
    unroll: int = 1,
    command: str = "",
) -> dict:
    """The four stages (see the module doc); returns and writes ``distill_summary.json``
    beside the head in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .named import resolve_model

    torch.set_num_threads(threads)
    model_dir = resolve_model(model)
    work = Path(work) if work is not None else Path(out) / ".." / f".distill-{Path(out).name}"
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    summary: dict = {"model": model, "seed": seed, "command": command}
    t0 = time.perf_counter()

    answers_file = work / "answers.safetensors"
    settings = {"n_prompts": n_prompts, "max_tokens": max_tokens, "seed": seed}
    answers = load_cached(answers_file, settings)
    if answers is None:
        prompts = prompt_ids(tok, training_texts(n_prompts, seed=seed))
        outputs = generate_answers(model_dir, prompts, max_tokens, temperature, seed)
        answers = _ragged([p + a for p, a in zip(prompts, outputs)])
        answers["prompt_lens"] = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        save_safetensors_atomic(answers, answers_file, settings)
    summary["answers_seconds"] = time.perf_counter() - t0
    seqs = _unragged(answers["ids"], answers["offsets"])

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    feats_file = work / "features.safetensors"
    of_answers = {"tokens": int(answers["ids"].numel())}  # features of these answers
    feats = load_cached(feats_file, of_answers)
    if feats is None:
        feats = target_features(target, seqs)
        save_safetensors_atomic(feats, feats_file, of_answers)
    data = {**answers, **feats}
    summary["tokens"] = int(answers["ids"].numel())

    eos = [t for t in {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} if t is not None]
    vocab = reduced_vocab(data["argmax"], vocab_size, eos)
    cover = float(torch.isin(data["argmax"].long(), vocab).float().mean())
    summary.update(vocab=len(vocab), vocab_coverage=cover)
    head = EagleHead.from_target(target, seed=seed)
    head.target_path = target_reference(model, model_dir)
    hist = train_head(head, data, vocab, minutes, unroll=unroll, seed=seed)
    summary["train"] = {k: v for k, v in hist.items()}
    head.restrict_vocab(vocab)  # it drafts over the vocabulary it was trained on
    head.save_pretrained(out, dtype=torch.bfloat16)

    held = heldout_prompt_ids(tok)
    ev_prompts = held[:eval_prompts]
    with torch.no_grad():
        greedy = [
            target.generate(torch.tensor([p]), max_new_tokens=eval_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in ev_prompts
        ]
    head = EagleHead.from_pretrained(out, target=target)
    summary["heldout"] = chain_acceptance(head, target, ev_prompts, greedy)
    summary["seconds"] = time.perf_counter() - t0
    _atomic_write(Path(out) / "distill_summary.json", json.dumps(summary, indent=1).encode())
    return summary
