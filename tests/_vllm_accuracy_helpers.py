"""Shared helpers of the vLLM accuracy tests: the committed tiny target, HF references,
and an offline ``LLM`` started with only this project's accuracy plugin."""

from __future__ import annotations

import contextlib
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "stdlib-v1", "target")
DRAFT = os.path.join(ROOT, "checkpoints", "stdlib-v1", "draft")
PROMPTS = ["def foo(x):\n    return", "import os\nclass Config:", "    for i in range(len("]


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


@contextlib.contextmanager
def only_plugins(names: str):
    """``VLLM_PLUGINS`` set while an engine starts (its processes inherit it)."""
    old = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = names
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = old


def make_llm(additional_config: dict, plugins: str = "treespec_accuracy", **kw):
    from vllm import LLM

    kw.setdefault("enforce_eager", True)
    with only_plugins(plugins):
        return LLM(
            model=TARGET,
            dtype="float32",
            max_model_len=512,
            additional_config=additional_config,
            **kw,
        )


def tokenize(prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    return [tok(p)["input_ids"] for p in prompts]


def hf_model(dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=dtype, attn_implementation="sdpa")


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of HF (full recompute each step)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def hf_outputs(model, ids: list[int], modules: list[str]) -> dict[str, torch.Tensor]:
    """``{module: [1, T, E]}`` outputs of one HF forward over ``ids`` (first tensor of a
    tuple), plus ``"logits"``."""
    mods = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    handles = [
        mods[m].register_forward_hook(
            lambda _m, _i, o, _n=m: out.__setitem__(_n, (o[0] if isinstance(o, tuple) else o))
        )
        for m in modules
    ]
    logits = model(input_ids=torch.tensor([ids])).logits
    for h in handles:
        h.remove()
    out["logits"] = logits
    return out
