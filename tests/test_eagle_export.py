"""The EAGLE head exported for vLLM's ``eagle`` proposer (``tree_dev.models.export_vllm``).

Fast part: the export's layout, weights, caching and input checks.  vLLM part (one
engine per module, ``enforce_eager``): vLLM's own ``eagle`` proposer with the exported
head computes the project's head (features, draft outputs and logits against HF in
fp32), its greedy chain accepts exactly what the local engine's ``chain:K`` accepts
with the head, and its output is the target's plain greedy decoding.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tree_dev.models import DEFAULT_CHECKPOINT, REPO_ROOT
from tree_dev.models.export_vllm import (
    ARCHITECTURE,
    DEFAULT_HEAD,
    export_eagle_for_vllm,
    head_digest,
)

TARGET = DEFAULT_CHECKPOINT / "target"
K = 4  # chain length (num_speculative_tokens)
N_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 40, 48

LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


@pytest.fixture(scope="module")
def models():
    from tree_dev.models import load

    return load()


# --------------------------------------------------------------------------- the export
def test_export_holds_the_heads_weights_under_vllm_names(tmp_path, models):
    out = export_eagle_for_vllm(tmp_path / "exp")
    assert out == tmp_path / "exp"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    hc = models.eagle.config
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        assert cfg[field] == getattr(hc, field), field
    assert cfg["num_key_value_heads"] == hc.num_key_value_heads
    assert cfg["rms_norm_eps"] == hc.rms_norm_eps
    assert cfg["treespec_eagle"]["source_sha256"] == head_digest(DEFAULT_HEAD)
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == {"fc.weight", "fc.bias", "norm.weight"} | {f"layers.0.{k}" for k in LAYER}
    head = models.eagle  # the project's head as the engine loads it (fp32)
    layer = head.decoder.layers[0]
    pairs = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias}
    pairs["norm.weight"] = head.decoder.norm.weight
    for k in LAYER:
        mod, name = k.rsplit(".", 1)
        pairs[f"layers.0.{k}"] = getattr(layer.get_submodule(mod), name)
    for k, ref in pairs.items():
        assert torch.equal(sd[k].float(), ref.detach()), k


def test_export_is_cached_by_digest_and_replaced_atomically(tmp_path):
    first = export_eagle_for_vllm(tmp_path / "exp")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert export_eagle_for_vllm(tmp_path / "exp") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten

    changed = tmp_path / "head"
    shutil.copytree(DEFAULT_HEAD, changed)
    sd = load_file(str(changed / "model.safetensors"))
    sd["fc.bias"] = sd["fc.bias"] + 1
    save_file(sd, str(changed / "model.safetensors"))
    assert head_digest(changed) != head_digest(DEFAULT_HEAD)
    again = export_eagle_for_vllm(tmp_path / "exp", head_dir=changed)
    assert again == first
    got = load_file(str(again / "model.safetensors"))["fc.bias"]
    assert torch.equal(got, sd["fc.bias"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "head"]  # no temp dirs left


def test_default_export_lives_under_results_keyed_by_digest():
    out = export_eagle_for_vllm()
    assert out == REPO_ROOT / "results" / "vllm_eagle" / head_digest(DEFAULT_HEAD)[:16]
    assert export_eagle_for_vllm() == out


def _bad_head(tmp_path, edit_cfg=None, edit_sd=None, source=DEFAULT_HEAD):
    """A copy of the head in ``source`` as ``tmp_path / "bad"``, its config and weights
    edited in place by ``edit_cfg(dict)`` / ``edit_sd(dict of tensors)``."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    if edit_cfg:
        cfg = json.loads((bad / "config.json").read_text())
        edit_cfg(cfg)
        (bad / "config.json").write_text(json.dumps(cfg))
    if edit_sd:
        sd = load_file(str(bad / "model.safetensors"))
        edit_sd(sd)
        save_file(sd, str(bad / "model.safetensors"))
    return bad


@pytest.mark.parametrize(
    "edit_cfg, edit_sd, match",
    [
        (lambda c: c.update(num_hidden_layers=2), None, "num_hidden_layers"),
        (lambda c: c.pop("eagle"), None, "'eagle' section"),
        (lambda c: c.update(hidden_size=0), None, "hidden_size"),
        (
            None,
            lambda s: s.update({"decoder.embed_tokens.weight": s["fc.bias"].clone()}),
            "embed_tokens",
        ),
        (None, lambda s: s.pop("decoder.norm.weight"), "decoder.norm.weight"),
        (None, lambda s: s.update({"fc.bias": s["fc.bias"][:-1]}), "fc.bias"),
    ],
)
def test_bad_head_is_refused_naming_the_field_before_writing(tmp_path, edit_cfg, edit_sd, match):
    bad = _bad_head(tmp_path, edit_cfg, edit_sd)
    with pytest.raises(ValueError, match=match):
        export_eagle_for_vllm(tmp_path / "out", head_dir=bad)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def _restricted_head(tmp_path, ids):
    """The committed toy head over the draft vocabulary ``ids``, saved under ``tmp_path``
    (its target given by absolute path, as ``distill-eagle`` names a directory)."""
    from tree_dev.models.eagle import EagleHead

    head = EagleHead.from_pretrained(DEFAULT_HEAD)
    head.target_path = str(TARGET.resolve())
    head.restrict_vocab(ids)
    head.save_pretrained(tmp_path / "small", dtype=torch.bfloat16)
    return tmp_path / "small"


def test_a_draft_vocabulary_exports_as_eagle3_lm_head_rows_and_d2t(tmp_path, models):
    ids = torch.arange(0, models.target.config.vocab_size, 3)
    out = export_eagle_for_vllm(tmp_path / "exp", head_dir=_restricted_head(tmp_path, ids))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(ids) and cfg["vocab_size"] == 4096
    assert cfg["treespec_eagle"]["shared_from_target"] == ["embed_tokens"]
    sd = load_file(str(out / "model.safetensors"))
    # the target's lm_head rows of the kept tokens (tied: its embedding), in the head's dtype
    want = models.target.get_output_embeddings().weight.detach()[ids].to(torch.bfloat16)
    assert torch.equal(sd["lm_head.weight"], want)
    assert sd["d2t"].dtype == torch.int64 and torch.equal(sd["d2t"] + torch.arange(len(ids)), ids)
    assert "draft_vocab" not in sd and sd["fc.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "edit_cfg, edit_sd, match",
    [
        (lambda c: c.update(draft_vocab_size=7), None, "draft_vocab_size 7"),
        (lambda c: c.pop("draft_vocab_size"), None, "draft_vocab_size None"),
        (None, lambda s: s.update(draft_vocab=s["draft_vocab"].flip(0)), "sorted and unique"),
        (None, lambda s: s.pop("draft_vocab"), "holds no draft_vocab"),
    ],
)
def test_a_bad_draft_vocabulary_is_refused_before_writing(tmp_path, edit_cfg, edit_sd, match):
    small = _restricted_head(tmp_path, torch.arange(0, 4096, 3))
    bad = _bad_head(tmp_path, edit_cfg, edit_sd, source=small)
    with pytest.raises(ValueError, match=match):
        export_eagle_for_vllm(tmp_path / "out", head_dir=bad)
    assert not (tmp_path / "out").exists()


def test_cli_prints_the_export_dir(tmp_path, capsys):
    from tree_dev.models.__main__ import main

    assert main(["export-eagle-vllm", "--out", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- inside vLLM
def _prompts() -> list[list[int]]:
    """Held-out windows of the committed eval slice, ``PROMPT_LEN`` tokens each."""
    w = load_file(str(DEFAULT_CHECKPOINT / "eval_slice.safetensors"))["windows"]
    step = (w.shape[1] - PROMPT_LEN) // (N_PROMPTS // w.shape[0])
    return [
        w[r, s : s + PROMPT_LEN].tolist()
        for r in range(w.shape[0])
        for s in range(0, N_PROMPTS // w.shape[0] * step, step)
    ]


@pytest.fixture(scope="module")
def vllm_eagle(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    import tree_dev.vllm_plugin.eagle_model  # noqa: F401  (registers the architecture here)

    export = export_eagle_for_vllm(tmp_path_factory.mktemp("vllm_eagle") / "head")
    llm = LLM(
        model=str(TARGET),
        speculative_config={"method": "eagle", "model": str(export), "num_speculative_tokens": K},
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        disable_log_stats=False,
        seed=0,
        worker_extension_cls="tree_dev.vllm_plugin.eagle_model.EagleCaptureExtension",
    )
    yield llm
    del llm


def _spec_metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "values", None) or m.value
    return out


def _greedy(llm, prompts, n):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.full  # a vLLM engine
def test_vllm_eagle_draft_computes_the_project_head(vllm_eagle, models):
    prompt = _prompts()[0]
    vllm_eagle.collective_rpc("treespec_eagle_capture", args=(True,))
    try:
        out = _greedy(vllm_eagle, [prompt], 2)[0]
    finally:
        records = vllm_eagle.collective_rpc("treespec_eagle_captured")[0]
        vllm_eagle.collective_rpc("treespec_eagle_capture", args=(False,))
    fwd = [r for r in records if r["kind"] == "forward"][:K]
    logits = [r for r in records if r["kind"] == "logits"][:K]
    assert len(fwd) == K and len(logits) == K
    # The first proposal: the prompt's pairs (x_{i+1}, h_i) in one forward, then K-1 steps
    # of one token each fed with the draft's own output.
    T = len(prompt)
    assert fwd[0]["input_ids"] == prompt[1:] + [out[0]]
    assert fwd[0]["positions"] == list(range(T))
    with torch.no_grad():
        feats = models.target.model(torch.tensor([prompt])).last_hidden_state[0]
    got_feats = torch.tensor(fwd[0]["hidden_states"])
    torch.testing.assert_close(got_feats, feats, atol=1e-4, rtol=1e-4)  # post final norm

    ids, hid, outs = list(fwd[0]["input_ids"]), [got_feats], [torch.tensor(fwd[0]["output"])]
    for j in range(1, K):
        assert fwd[j]["positions"] == [T - 1 + j]
        assert torch.equal(torch.tensor(fwd[j]["hidden_states"]), outs[-1][-1:])
        ids += fwd[j]["input_ids"]
        hid.append(torch.tensor(fwd[j]["hidden_states"]))
        outs.append(torch.tensor(fwd[j]["output"]))
    positions = torch.arange(1, len(ids) + 1)[None]  # the project's convention: i + 1
    with torch.no_grad():
        ref = models.eagle(torch.tensor([ids]), torch.cat(hid)[None], position_ids=positions)
    g, ref_logits = ref.hidden_states[0], ref.logits[0]
    torch.testing.assert_close(torch.cat(outs), g, atol=1e-4, rtol=1e-4)
    rows = [T - 1 + j for j in range(K)]  # logits of the sampled row of each forward
    got_logits = torch.cat([torch.tensor(r["logits"]) for r in logits])
    torch.testing.assert_close(got_logits, ref_logits[rows], atol=2e-4, rtol=1e-4)
    # the drafted chain is the argmax chain of the project's head
    assert [r["input_ids"][0] for r in fwd[1:]] == ref_logits[rows[:-1]].argmax(-1).tolist()


@pytest.mark.full  # a vLLM engine
def test_vllm_eagle_chain_accepts_what_the_local_engine_accepts(vllm_eagle, models):
    from tree_dev.engine import Engine, SamplingParams

    prompts = _prompts()
    before = _spec_metrics(vllm_eagle)
    outs = _greedy(vllm_eagle, prompts, NEW_TOKENS)
    after = _spec_metrics(vllm_eagle)
    v = {
        k: (after[k] - before.get(k, 0))
        if not isinstance(after[k], list)
        else [a - b for a, b in zip(after[k], before.get(k, [0] * len(after[k])))]
        for k in after
    }

    # plain greedy decoding of the target in HF (prompts of equal length: one batch;
    # EOS is an ordinary token here, as with vLLM's ignore_eos)
    with torch.no_grad():
        step = models.target(torch.tensor(prompts), use_cache=True)
        ref = []
        for _ in range(NEW_TOKENS):
            ref.append(step.logits[:, -1].argmax(-1, keepdim=True))
            step = models.target(ref[-1], past_key_values=step.past_key_values, use_cache=True)
    assert outs == torch.cat(ref, 1).tolist()

    # vLLM's first step is the prefill (no drafts); the local engine drafts from its first
    # step, so it starts one token later: prompt + the first greedy token.
    eng = Engine(models.target, eagle=models.eagle, tree=f"chain:{K}", max_batch=1)
    stats = []
    for p, o in zip(prompts, outs):
        rid = eng.add_request(p + o[:1], SamplingParams(max_tokens=NEW_TOKENS - 1, ignore_eos=True))
        while eng.has_work():
            eng.step()
        assert eng.requests[rid].output == o[1:]
        stats.append(eng.requests[rid])
    local = {
        "num_drafts": sum(r.steps for r in stats),
        "num_accepted_tokens": sum(r.accepted_drafts for r in stats),
        "per_pos": [sum(r.depth_accepted[d] for r in stats) for d in range(K)],
    }
    # Step counts may differ by one at the end of a request (how each engine reaches
    # max_tokens: seen once in 20 requests of 96 tokens); what is accepted may not.
    assert 0 <= local["num_drafts"] - v["num_drafts"] <= len(prompts)
    assert v["num_draft_tokens"] == K * v["num_drafts"]
    assert v["num_accepted_tokens"] == local["num_accepted_tokens"] > v["num_drafts"]
    assert v["num_accepted_tokens_per_pos"] == local["per_pos"]


@pytest.mark.full  # a vLLM engine
def test_the_vllm_plugin_entry_point_registers_the_architecture(vllm_eagle):
    """Without ``worker_extension_cls`` the plugin's ``register()`` (run by vLLM in every
    process) is what makes the exported head loadable."""
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    import tree_dev.vllm_plugin

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "treespec_tree"]
    assert ep.load() is tree_dev.vllm_plugin.register
    ModelRegistry.models.pop(ARCHITECTURE)
    assert ARCHITECTURE not in ModelRegistry.get_supported_archs()
    tree_dev.vllm_plugin.register()
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
