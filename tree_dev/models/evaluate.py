"""Held-out evaluation: perplexity, bits per byte, draft agreement and top-K hit rates.

All models run in fp32 (the engine's CPU dtype) on non-overlapping windows of the
validation stream (``seq_len + 1`` tokens each).  Every metric is computed on the
same positions: target positions ``1 .. seq_len - 1`` of each window, i.e. the
predictions of tokens ``x_2 .. x_T`` (the EAGLE head needs ``h_0`` and ``x_1`` before
its first prediction, so position 0 is dropped for every model alike).

- ``ppl = exp(mean nats per token)``; ``bpb = total nats / ln 2 / UTF-8 bytes`` of the
  predicted tokens (EOS counts 0 bytes, its loss is kept).
- ``agree_top1``: fraction of positions where the draft's argmax equals the target's.
- ``topk_hit[K]``: fraction where the target's argmax is among the draft's top-K.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import ModelSet, data, load

KS = (1, 2, 4, 8)


class _Acc:
    def __init__(self) -> None:
        self.nll = 0.0
        self.ntok = 0
        self.nbytes = 0
        self.hits = dict.fromkeys(KS, 0)

    def add(self, logits, labels, target_argmax, nbytes) -> None:
        lf = logits.float().flatten(0, -2)
        self.nll += float(F.cross_entropy(lf, labels.flatten(), reduction="sum"))
        self.ntok += labels.numel()
        self.nbytes += int(nbytes[labels].sum())
        if target_argmax is not None:
            top = lf.topk(max(KS), -1).indices
            hit = top == target_argmax.flatten()[:, None]
            for k in KS:
                self.hits[k] += int(hit[:, :k].any(-1).sum())

    def result(self, with_agree: bool) -> dict:
        nats = self.nll / self.ntok
        out = {
            "nats_per_token": nats,
            "ppl": math.exp(nats),
            "bpb": self.nll / math.log(2) / self.nbytes,
            "tokens": self.ntok,
            "bytes": self.nbytes,
        }
        if with_agree:
            out["agree_top1"] = self.hits[1] / self.ntok
            out["topk_hit"] = {str(k): self.hits[k] / self.ntok for k in KS}
        return out


@torch.no_grad()
def evaluate(models: ModelSet, windows: torch.Tensor, nbytes: torch.Tensor, batch: int = 8) -> dict:
    """Metrics of target, draft and EAGLE head on ``windows int64[W, T + 1]`` (see module doc)."""
    if windows.dim() != 2 or windows.shape[1] < 3:
        raise ValueError(f"windows must be int64[W, T + 1] with T >= 2, got {tuple(windows.shape)}")
    acc = {"target": _Acc(), "draft": _Acc(), "eagle": _Acc()}
    t, d, e = models.target.eval(), models.draft.eval(), models.eagle.eval()
    for w in tqdm(windows.split(batch), desc="eval", mininterval=5):
        x = w[:, :-1]
        h = t.model(input_ids=x).last_hidden_state
        tl = t.lm_head(h)  # [B, T, V]: position i predicts x[i + 1]
        labels = w[:, 2:]  # positions 1 .. T-1
        tam = tl[:, 1:].argmax(-1)
        acc["target"].add(tl[:, 1:], labels, None, nbytes)
        acc["draft"].add(d(input_ids=x).logits[:, 1:], labels, tam, nbytes)
        pos = torch.arange(1, x.shape[1])[None].expand(x.shape[0], -1)
        el = e(x[:, 1:], h[:, :-1], position_ids=pos).logits  # head pos i+1 predicts x[i + 2]
        acc["eagle"].add(el, labels, tam, nbytes)
    return {k: a.result(with_agree=k != "target") for k, a in acc.items()}


def val_windows(tokenizer, seq_len: int, n: int | None) -> torch.Tensor:
    """The first ``n`` held-out windows of the deterministic validation split."""
    _, val_files = data.corpus_files()
    stream = data.encode_stream(tokenizer, data.read_texts(val_files))
    return data.eval_windows(stream, seq_len, n)


def record_slice(path: str | os.PathLike, models: ModelSet, windows: torch.Tensor) -> dict:
    """Store ``windows`` and their metrics as ``eval_slice.{safetensors,json}`` in ``path``.

    The test suite re-evaluates the committed checkpoint on exactly these tokens,
    independent of the interpreter whose standard library is installed.
    """
    from safetensors.torch import save_file

    p = Path(path)
    res = evaluate(models, windows, data.token_byte_lengths(models.tokenizer))
    tmp = p / "eval_slice.safetensors.tmp"
    save_file({"windows": windows.to(torch.int32).contiguous()}, str(tmp))
    os.replace(tmp, p / "eval_slice.safetensors")
    rec = {"windows": int(windows.shape[0]), "seq_len": int(windows.shape[1] - 1), "models": res}
    tmp = p / "eval_slice.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, p / "eval_slice.json")
    return rec


def run_eval(
    path: str | os.PathLike,
    json_out: str | os.PathLike,
    n_windows: int = 64,
    command: str = "",
    record: int = 0,
) -> dict:
    """Evaluate the checkpoint at ``path``; write JSON (and a PNG next to it); print a table.

    ``record > 0``: also store the first ``record`` windows and their metrics in the
    checkpoint directory (see :func:`record_slice`).
    """
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    models = load(path)
    seq_len = models.target.config.max_position_embeddings
    windows = val_windows(models.tokenizer, seq_len, n_windows)
    nbytes = data.token_byte_lengths(models.tokenizer)
    res = evaluate(models, windows, nbytes)
    n_params = {
        "target": sum(p.numel() for p in models.target.parameters()),
        "draft": sum(p.numel() for p in models.draft.parameters()),
        "eagle": sum(v.numel() for v in models.eagle.trainable_state_dict().values()),
    }
    for k in res:
        res[k]["params"] = n_params[k]
    report = {
        "checkpoint": str(path),
        "dtype": "float32",
        "windows": int(windows.shape[0]),
        "seq_len": seq_len,
        "command": command,
        "seconds": time.perf_counter() - t0,
        "models": res,
    }
    out = Path(json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    print(
        f"{'model':8} {'params':>9} {'ppl':>8} {'bpb':>6} {'agree':>6} "
        + " ".join(f"{'top' + str(k):>6}" for k in KS)
    )
    for k, r in res.items():
        hits = " ".join(f"{r['topk_hit'][str(q)]:6.3f}" for q in KS) if "topk_hit" in r else ""
        agree = f"{r['agree_top1']:6.3f}" if "agree_top1" in r else " " * 6
        print(f"{k:8} {r['params']:9d} {r['ppl']:8.2f} {r['bpb']:6.3f} {agree} {hits}")
    print(f"wrote {out} ({report['windows']} windows x {seq_len} tokens, {report['seconds']:.0f}s)")
    _plot(report, out.with_suffix(".png"), Path(path) / "train_summary.json")
    if record:
        record_slice(path, models, windows[:record])
        print(f"recorded {record} windows in {Path(path) / 'eval_slice.json'}")
    return report


def _plot(report: dict, png: Path, summary: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    for name in ("draft", "eagle"):
        r = report["models"][name]
        ax.plot(KS, [r["topk_hit"][str(k)] for k in KS], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(KS, [str(k) for k in KS])
    ax.set_xlabel("K")
    ax.set_ylabel("P(target argmax in draft top-K)")
    ax.set_title("Draft top-K hit rate, held-out stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    if summary.is_file():
        st = json.loads(summary.read_text())["stages"]
        for name in ("target", "draft"):
            if name in st:
                ax.plot(st[name]["step"], st[name]["val_bpb"], label=name)
        ax.axhline(2.0, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("val bits/byte (bf16, training)")
        ax.set_title("Training curves")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")
