"""The accuracy tooling inside a real vLLM engine (eager; one engine for the module).

The engine carries a planted bug (layer 2's MLP output scaled by 2) and replaces layers
0-1 with HF's outputs. Tested through it: the capture layout and its scheduler metadata,
the planted bug named first by both two-way and three-way comparison against HF,
replacement values equal HF's at vLLM's positions, logit validation with teacher forcing
whose retries are new vLLM requests mapped back by the longest verified prefix match
(the design's corner cases), and bad input at start-up.
"""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _vllm_accuracy_helpers import (  # noqa: E402
    PROMPTS,
    have_vllm,
    hf_greedy,
    hf_model,
    hf_outputs,
    make_llm,
    tokenize,
)

pytestmark = [
    pytest.mark.full,  # make test-all only: vLLM engines
    pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed (scripts/setup)"),
]

STEPS = 10
REPLACED = ["model.layers.0", "model.layers.1"]
FAULT = {"module": "model.layers.2.mlp", "scale": 2.0}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from accuracy import in_vllm
    from accuracy.vllm_compare import hf_module_patterns

    root = tmp_path_factory.mktemp("vllm_acc")
    hf = hf_model()
    prompts = tokenize(PROMPTS)
    p0 = prompts[0]
    g0 = hf_greedy(hf, p0, STEPS + 2)
    # a stored prompt that extends prompt 0 with tokens HF would not generate there
    other = [t for t in range(5, 50) if t not in g0[:2]][:2]
    stored = [p0, p0 + other, prompts[1]]
    greedy = [g0, hf_greedy(hf, stored[1], STEPS + 2), hf_greedy(hf, stored[2], STEPS + 2)]
    refs = [hf_outputs(hf, s + g, REPLACED) for s, g in zip(stored, greedy, strict=True)]
    tensors = [{m: [r[m]] for m in REPLACED} for r in refs]
    cfg = {
        "treespec": {
            "tensor_capture": {"modules": hf_module_patterns(6), "capture_dir": str(root / "v")},
            "tensor_replacement": in_vllm.replacement_config(tensors, stored),
            "fault_injection": FAULT,
            "tree": "ignored: another plugin's key",
        }
    }
    llm = make_llm(cfg, max_logprobs=-1)
    yield {
        "llm": llm,
        "root": root,
        "hf": hf,
        "stored": stored,
        "greedy": greedy,
        "refs": refs,
    }
    del llm


def _generate(llm, ids: list[list[int]], n: int, logprobs: bool = False):
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=-1 if logprobs else None
    )
    return llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False)


@pytest.fixture(scope="module")
def first_run(env):
    """Prompts 0 and 2 of the stored set, STEPS greedy tokens each."""
    from accuracy.tensor_io import read

    stored = env["stored"]
    outs = _generate(env["llm"], [stored[0], stored[2]], STEPS)
    fwds = read(str(env["root"] / "v"))
    return outs, fwds


def _internal(fwds, external: str) -> str:
    """vLLM's internal request id (``{external}-{suffix}``) seen in the captures."""
    hits = {r for f in fwds for r in f.metadata.req_ids if r.rsplit("-", 1)[0] == external}
    assert len(hits) == 1, (external, hits)
    return hits.pop()


def _prompt_idx(root) -> dict[str, int]:
    """External request id -> replacement prompt index, from the capture metadata."""
    from accuracy.tensor_io import read

    out = {}
    for f in read(str(root / "v")):
        for r, i in (f.metadata.extra.get("replacement_prompt_idx") or {}).items():
            out[r.rsplit("-", 1)[0]] = i
    return out


def test_capture_layout_and_scheduler_metadata(env, first_run):
    outs, fwds = first_run
    root = env["root"] / "v"
    assert (root / "manifest.json").is_file()
    names = [f.dir_name for f in fwds]
    assert names[0].startswith("prefill_s") and any(n.startswith("decode_b2_") for n in names)
    first = fwds[0]
    assert (root / "dp0" / first.dir_name / "model.layers.0" / "rank0.safetensors").is_file()
    assert (root / "dp0" / first.dir_name / f"{first.dir_name}_meta.json").is_file()
    rids = [_internal(fwds, o.request_id) for o in outs]
    assert set(first.metadata.req_ids) <= set(rids)
    dec = next(f for f in fwds if f.dir_name.startswith("decode_b2_"))
    assert dec.metadata.req_ids == rids
    # positions = tokens already computed for each request (the scheduler's view)
    assert dec.metadata.positions == dec.metadata.extra["num_computed_tokens"]
    assert dec.metadata.extra["prefilling"] == [False, False]
    assert dec.tensors["model.layers.3"][0].shape == (2, 2, 256)  # (hidden, residual) pair
    assert dec.tensors["lm_head"][0].shape == (2, 4096)
    ids = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in outs]
    for r, rid in enumerate(dec.metadata.req_ids):
        p = dec.metadata.positions[r]
        assert dec.metadata.token_ids[r] == ids[rids.index(rid)][p]


def test_planted_bug_is_named_first_by_two_way_and_three_way(env, first_run, tmp_path):
    from accuracy.vllm_compare import capture_hf_reference, compare_hf_vllm, hf_module_patterns

    outs, _ = first_run
    seqs = [(o.prompt_token_ids, list(o.outputs[0].token_ids)) for o in outs]
    capture_hf_reference(env["hf"], seqs, hf_module_patterns(6), str(tmp_path / "fp32"))
    capture_hf_reference(
        hf_model(torch.bfloat16), seqs, hf_module_patterns(6), str(tmp_path / "bf16")
    )
    buf = io.StringIO()
    s2, s3, f2, f3 = compare_hf_vllm(
        str(tmp_path / "fp32"), str(tmp_path / "bf16"), str(env["root"] / "v"), file=buf
    )
    text = buf.getvalue()
    assert not s2.ok and not s3.ok
    assert f2[:2] == ("prompt_0", 0) and f2[2].startswith("model_layers_2_mlp/")
    assert f3[:2] == ("prompt_0", 0) and f3[2].startswith("model_layers_2_mlp/")
    assert text.count("SUMMARY:") == 2
    # everything before the planted bug (layers 0-1 replaced, layer 2 attention) matches
    before = text.split("model_layers_2_mlp/token0")[0].split("=== prompt_0 ===")[1]
    assert "e-0" in before and "e+" not in before.replace("e+00", "")


def test_replaced_layers_equal_hf_at_vllms_positions(env, first_run):
    _, fwds = first_run
    refs = env["refs"]
    checked = 0
    for f in fwds:
        table = f.metadata.extra["slot_table"]
        prompt_of = f.metadata.extra["replacement_prompt_idx"]
        for r, (off, cnt) in enumerate(table):
            pi = prompt_of[f.metadata.req_ids[r]]
            pos = f.metadata.positions[off : off + cnt]
            for m in REPLACED:
                pair = f.tensors[m][0][:, off : off + cnt]
                got = pair[0] + pair[1]
                want = refs[pi][m][0, pos]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
                checked += 1
    assert checked >= 2 * STEPS


def test_logit_validation_retries_as_new_requests_matched_by_prefix(env):
    from accuracy import logit_validation

    llm, stored, greedy, hf = env["llm"], env["stored"], env["greedy"], env["hf"]
    prompts = [stored[0], stored[2]]
    gen = [greedy[0][:STEPS], greedy[2][:STEPS]]
    with torch.no_grad():
        expected = torch.stack(
            [
                hf(input_ids=torch.tensor([p + g[:-1]])).logits[0, len(p) - 1 :]
                for p, g in zip(prompts, gen, strict=True)
            ],
            1,
        )  # [STEPS, 2, vocab]
    seen: list[list[str]] = []

    def generate_fn(ids):
        n = STEPS - (len(ids[0]) - len(prompts[0]))
        outs = _generate(llm, ids, n, logprobs=True)
        seen.append([o.request_id for o in outs])
        logits = torch.full((n, len(ids), expected.shape[-1]), -1e4)
        for b, o in enumerate(outs):
            for t, lp in enumerate(o.outputs[0].logprobs):
                for tok, v in lp.items():
                    logits[t, b, tok] = v.logprob
        return logits

    res = logit_validation(prompts, generate_fn, expected, return_details=True, file=io.StringIO())
    assert not res.passed  # the planted bug changes tokens...
    assert res.num_generate_calls >= 2 and res.divergence_indices
    # ...and every retry is a new vLLM request that replacement maps to its own prompt
    by_req = _prompt_idx(env["root"])
    for call in seen[1:]:
        assert [by_req[r] for r in call] == [0, 2]


def test_prefix_match_corner_cases_through_vllm(env):
    llm, stored = env["llm"], env["stored"]
    p0, p1 = stored[0], stored[1]
    cases = {
        "exact longer prompt": (p1, 1),
        "retry of prompt 0 with other tokens": (p0 + [p1[len(p0)] + 1, 7], 0),
        "shorter than prompt 1": (p0 + p1[len(p0) : len(p0) + 1], 0),
        "retry of prompt 0 reproducing prompt 1 (known corner case)": (p1 + [9], 1),
    }
    outs = _generate(llm, [ids for ids, _ in cases.values()], 1)
    by_req = _prompt_idx(env["root"])
    got = {k: by_req[o.request_id] for k, o in zip(cases, outs, strict=True)}
    assert got == {k: want for k, (_, want) in cases.items()}


# a failed engine start-up takes a minute or more here; the check itself
def test_unknown_module_pattern_fails_at_start_up_naming_it(tmp_path, capfd):
    """Runs in the worker (test_accuracy_vllm_units tests it fast); here: it reaches the user."""
    cfg = {
        "treespec": {
            "tensor_capture": {"modules": ["model.layerz.0"], "capture_dir": str(tmp_path)}
        }
    }
    with pytest.raises(Exception):  # noqa: B017 - vLLM wraps the worker's ValueError
        make_llm(cfg)
    err = capfd.readouterr()
    assert "unknown module pattern(s) ['model.layerz.0']" in err.out + err.err


def test_unwritable_capture_dir_fails_before_any_worker(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    cfg = {"treespec": {"tensor_capture": {"modules": ["lm_head"], "capture_dir": str(blocker)}}}
    with pytest.raises(ValueError, match=f"capture_dir '{blocker}' is not writable"):
        make_llm(cfg)
