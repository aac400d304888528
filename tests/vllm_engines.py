"""vLLM engines on the committed tiny models, shared by the plugin's test modules.

One engine per test module (start-up is 10-30 s); the plain-decoding reference outputs
are computed once per session and mode (eager or compiled) by ``plain_outputs``.
"""

from __future__ import annotations

import os
from pathlib import Path

from tree_dev.testing import shutdown_engine

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "stdlib-v1"
TARGET = str(CHECKPOINT / "target")
DRAFT = str(CHECKPOINT / "draft")
MAX_MODEL_LEN = 512


def held_out_prompts(n: int, seed: int = 0, lo: int = 8, hi: int = 160) -> list[list[int]]:
    """``n`` token prompts of mixed lengths in ``[lo, hi]`` from held-out stdlib files."""
    import random

    from tree_dev.models.data import corpus_files, load_tokenizer, read_texts

    tok = load_tokenizer(CHECKPOINT / "tokenizer")
    _, val = corpus_files()
    rng = random.Random(seed)
    streams = [ids for ids in (tok.encode(t) for t in read_texts(val)) if len(ids) > 2 * hi]
    out = []
    for i in range(n):
        ids = streams[i % len(streams)]
        length = rng.randint(lo, hi)
        start = rng.randint(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def max_tokens_for(i: int) -> int:
    """Mixed output lengths, so requests leave a continuous batch at different times."""
    return (24, 64, 40, 96, 32, 56, 80, 48)[i % 8]


def load_tree_plugin() -> None:
    """The tree plugin in this process (its hooks, its EAGLE architecture), as vLLM loads
    it at a process's first engine when ``VLLM_PLUGINS`` is not narrowed; vLLM does that
    once, so a test process whose first engine ran with only the accuracy plugin would
    otherwise lack it (``register`` is idempotent and inert without a ``treespec`` key)."""
    from tree_dev.vllm_plugin import register

    register()


def make_llm(enforce_eager: bool = True, **kw):
    from vllm import LLM

    load_tree_plugin()

    args = dict(
        model=TARGET,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=enforce_eager,
        disable_log_stats=False,
        seed=0,
    )
    args.update(kw)
    return LLM(**args)


def real_model_llm(model_dir, **kw):
    """A vLLM ``LLM`` on a real pretrained model's directory: fp32, eager (compiled
    start-up is minutes on a 30-layer model here), 512 tokens, 8 sequences, seed 0, stats
    logged; ``kw`` adds or overrides ``LLM`` arguments."""
    from vllm import LLM

    load_tree_plugin()

    args = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,
    )
    args.update(kw)
    return LLM(**args)


_REAL_PLAIN: dict[tuple, list[list[int]]] = {}


def real_model_plain(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """vLLM's own plain greedy outputs of ``prompts`` on a real model (``real_model_llm``),
    computed once per session and shared by the modules that compare against them."""
    from vllm import SamplingParams

    key = (str(model_dir), tuple(map(tuple, prompts)), max_tokens)
    if key not in _REAL_PLAIN:
        llm = real_model_llm(model_dir)
        try:
            params = [SamplingParams(temperature=0, max_tokens=max_tokens) for _ in prompts]
            _REAL_PLAIN[key] = generate(llm, prompts, params)
        finally:
            shutdown_engine(llm)
    return _REAL_PLAIN[key]


shutdown = shutdown_engine  # the modules' name for it


def generate(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Token ids of each output; ``params`` one ``SamplingParams`` or one per prompt."""
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_params(n: int):
    from vllm import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=max_tokens_for(i), ignore_eos=True)
        for i in range(n)
    ]


def spec_metrics(llm) -> dict:
    """vLLM's own spec-decode counters (acceptance per position = per depth for trees)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.split(":", 1)[1]] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def tree_stats(llm) -> dict:
    """The plugin's per-depth statistics from the worker (``TreeRunner.stats``)."""
    return llm.collective_rpc("treespec_tree_stats")[0]


_PLAIN: dict[tuple, list[int]] = {}


def plain_outputs(
    prompts: list[list[int]], enforce_eager: bool = True, params: list | None = None
) -> list[list[int]]:
    """vLLM's own plain outputs for ``prompts`` (greedy ``greedy_params`` unless ``params``
    is given, one per prompt). Cached per (prompt, params) for the session: modules that
    share prompts share one plain engine run."""
    params = params if params is not None else greedy_params(len(prompts))
    keys = [(enforce_eager, tuple(p), repr(x)) for p, x in zip(prompts, params)]
    if any(k not in _PLAIN for k in keys):
        # one plain engine run for these and every module's standard requests
        reqs = list(zip(prompts, params)) + [r for r in STANDARD() if enforce_eager]
        todo = {}
        for p, x in reqs:
            key = (enforce_eager, tuple(p), repr(x))
            if key not in _PLAIN:
                todo[key] = (p, x)
        llm = make_llm(enforce_eager=enforce_eager, max_num_seqs=8)
        try:
            outs = generate(llm, [p for p, _ in todo.values()], [x for _, x in todo.values()])
        finally:
            shutdown(llm)
        _PLAIN.update(zip(todo, outs))
    return [_PLAIN[k] for k in keys]


PROMPTS = held_out_prompts(50, seed=1)  # the prompts every plugin module decodes
FALLBACK = held_out_prompts(6, seed=7)  # requests with chain-only sampling features
# 25 long prompts, then each one's first 130 tokens with a new ending: the second half's
# first KV block (128 tokens) comes from vLLM's prefix cache
_LONG = held_out_prompts(25, seed=6, lo=140, hi=180)
SHARED = _LONG + [p[:130] + q[:12] for p, q in zip(_LONG, PROMPTS)]


def fallback_params():
    """Sampling features that assume chains: tree engines decode these requests plainly."""
    from vllm import SamplingParams

    kw = [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.8},
        {"frequency_penalty": 0.5},
        {"logprobs": 2},
        {"min_tokens": 30},
        {"bad_words": ["def"]},
    ]
    return [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **k) for k in kw]


def STANDARD() -> list[tuple[list[int], object]]:  # noqa: N802
    """Every eager module's plain requests, computed in one plain engine run."""
    reqs = list(zip(PROMPTS, greedy_params(len(PROMPTS))))
    reqs += list(zip(FALLBACK, fallback_params()))
    reqs += list(zip(SHARED, greedy_params(len(SHARED))))
    return reqs


BATCH1 = 16  # prompts run one at a time by assert_lossless(batch1=True)


def assert_lossless(llm, prompts: list[list[int]], reference: list[list[int]], batch1: bool):
    """Greedy outputs equal ``reference`` token for token: the first ``BATCH1`` prompts
    one request at a time (``batch1``), or all of them submitted together (the engine's
    ``max_num_seqs`` bounds the concurrency). Every module runs both, so every prompt is
    proven concurrently and the first 16 alone too."""
    params = greedy_params(len(prompts))
    if batch1:
        prompts, reference = prompts[:BATCH1], reference[:BATCH1]
        outs = [generate(llm, [p], params[i])[0] for i, p in enumerate(prompts)]
    else:
        outs = generate(llm, prompts, params)
    diverged = [i for i, (a, b) in enumerate(zip(outs, reference)) if a != b]
    assert not diverged, f"prompts {diverged} diverge from vLLM's plain greedy output"


def target_probs(prefix: list[int], temperature: float, model_dir: str | Path = TARGET):
    """The HF target's next-token distribution after ``prefix`` at ``temperature``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1]
    return torch.softmax(logits / temperature, dim=-1)


def assert_first_tree_token_is_targets(
    llm,
    prompt: list[int],
    temperature: float = 0.8,
    n: int = 1500,
    mode: str | None = None,
    model_dir: str | Path = TARGET,
    min_tree_steps: int | None = None,
) -> None:
    """Lossless sampling: ``n`` two-token requests; the second token (the first a tree step
    emits) given the most frequent first one is distributed as the target's (chi-square,
    p > 1e-3). With ``mode``, every one of those tree steps walked in that mode."""
    import torch
    from scipy.stats import chisquare
    from vllm import SamplingParams

    before = tree_stats(llm)
    # unseeded: vLLM 0.32's CPU runner cannot rewind a seeded request's generator when a
    # chunked prefill discards a sample ("CPU Generator does not use offset")
    params = [SamplingParams(temperature=temperature, max_tokens=2) for _ in range(n)]
    outs = generate(llm, [prompt] * n, params)
    after = tree_stats(llm)
    firsts = torch.tensor([o[0] for o in outs])
    x1 = int(torch.mode(firsts).values)  # condition on the most likely first token
    seconds = torch.tensor([o[1] for o in outs if o[0] == x1])
    assert len(seconds) > 300
    p = target_probs(prompt + [x1], temperature, model_dir)
    order = torch.argsort(p, descending=True)
    exp = p[order] * len(seconds)
    k = int((exp >= 5).sum())  # bins with >= 5 expected, the rest pooled
    obs = torch.stack([(seconds == t).sum() for t in order[:k]]).float()
    obs = torch.cat([obs, (len(seconds) - obs.sum()).view(1)])
    exp = torch.cat([exp[:k], (len(seconds) - exp[:k].sum()).view(1)])
    assert k >= 2
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
    # every second token came from a tree step (a trie: at least those after x1, which
    # the prompt's earlier text continues)
    need = n if min_tree_steps is None else min_tree_steps
    steps = after["tree_steps"] - before["tree_steps"]
    assert steps >= need, f"{steps} tree steps of {n} requests; the test needs {need}"
    if mode is not None:
        walked = after["walks"].get(mode, 0) - before["walks"].get(mode, 0)
        assert walked >= n, (mode, before["walks"], after["walks"])
