"""Tensor replacement from memory and disk, and teacher-forced logit validation."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from accuracy import (
    ModelCapture,
    TensorReplacementConfig,
    TensorReplacer,
    install_replacement_hooks,
    logit_validation,
    set_active_context,
)
from accuracy.replacement import save_reference_captures

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

V = 11


def _table_model(shift: torch.Tensor | None = None):
    """Logits of the next token = row of a fixed table picked by the last token."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 3
    if shift is not None:
        table = table + shift

    def logits_after(seq):
        return table[seq[-1] % V]

    return logits_after


def _gen(logits_after, n, seen):
    def generate_fn(input_ids):
        seen.append([list(x) for x in input_ids])
        outs = []
        for seq in input_ids:
            seq = list(seq)
            rows = []
            for _ in range(n):
                row = logits_after(seq)
                rows.append(row)
                seq.append(int(row.argmax()))
            outs.append(torch.stack(rows))
        return torch.stack(outs, 1)  # [gen, batch, vocab]

    return generate_fn


def _expected(logits_after, prompts, n):
    return _gen(logits_after, n, [])(prompts)


def test_logit_validation_identical_model_one_call():
    ref = _table_model()
    prompts = [[1, 2], [3]]
    seen = []
    res = logit_validation(
        prompts, _gen(ref, 6, seen), _expected(ref, prompts, 6), return_details=True
    )
    assert res.passed and res.num_generate_calls == 1 and res.divergence_indices == []
    assert len(res.tokens[0]) == len(res.tokens[1]) == 6
    assert prompts == [[1, 2], [3]]  # caller's lists untouched


def test_logit_validation_retries_with_teacher_forcing_on_divergence():
    ref = _table_model()
    prompts = [[4]]
    exp = _expected(ref, prompts, 6)
    ref_tokens = exp.argmax(-1)[:, 0].tolist()
    # make the test model prefer a different token after ref_tokens[1]
    bad_row = ref_tokens[1] % V
    shift = torch.zeros(V, V)
    alt = (ref_tokens[2] + 1) % V
    shift[bad_row, alt] = 100.0
    seen = []
    res = logit_validation(prompts, _gen(_table_model(shift), 6, seen), exp, return_details=True)
    assert not res.passed
    assert res.divergence_indices[0] == 2
    # the retry re-prompts with the reference tokens up to and including the divergence
    assert seen[1][0] == [4] + ref_tokens[:3]
    assert res.num_generate_calls >= 2
    statuses = [t.status for t in res.tokens[0]]
    assert statuses[2] == "diverged" and statuses[:2] == ["matched", "matched"]
    assert len(statuses) == 6  # every position validated once
    # two-way return value is the bare flag
    assert logit_validation(prompts, _gen(_table_model(shift), 6, []), exp) is False


def test_logit_validation_three_way_and_shape_errors():
    ref = _table_model()
    prompts = [[7]]
    base = _expected(ref, prompts, 4)
    noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(3)) * 1e-3
    expected = base + noise
    ok, results = logit_validation(
        prompts, lambda ids: base + 1.2 * noise, expected, baseline_logits=base
    )
    assert ok and results[0][0].three_way["tgt_linf"] > 0
    bad, _ = logit_validation(prompts, lambda ids: base + 3 * noise, expected, baseline_logits=base)
    assert not bad
    with pytest.raises(ValueError, match="expected_logits must be"):
        logit_validation(prompts, lambda ids: base, base[:, :, 0])
    with pytest.raises(ValueError, match="generate_fn returned logits"):
        logit_validation(prompts, lambda ids: base[:0], base)


@pytest.fixture(scope="module")
def llama_setup():
    sys.path.insert(0, os.path.dirname(__file__))
    from _accuracy_llama import tiny_llama

    ref = tiny_llama()
    pert = tiny_llama()
    with torch.no_grad():
        pert.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    return ref, pert


def test_replacement_makes_perturbed_llama_pass_logit_validation(llama_setup, tmp_path):
    ref, pert = llama_setup
    prompt, n = [5, 17, 33, 2, 90, 11], 5
    name = "model.layers.1.mlp"
    cap = ModelCapture(ref, [name], str(tmp_path / "unused"))
    steps, logits = [], []
    ids = list(prompt)
    with torch.no_grad():  # HF-style reference: full recompute each step
        for _ in range(n):
            cap.clear()
            cap.setup_tensor_capture()
            out = ref(torch.tensor([ids])).logits[0, -1]
            cap.save_tensor_captures(None, True)
            steps.append(cap.registry.get_all()[0][1])
            logits.append(out)
            ids.append(int(out.argmax()))
    cap.remove()
    expected = torch.stack(logits)[:, None]
    path = str(tmp_path / "ref.safetensors")
    save_reference_captures(path, [{name: steps}])
    with open(tmp_path / "ids.json", "w") as f:
        json.dump([prompt], f)
    cfg = TensorReplacementConfig.from_dict(
        {"tensors_path": path, "prompt_token_ids_path": str(tmp_path / "ids.json")}
    )
    replacer = cfg.build_replacer()
    assert replacer.flat[0][name].shape == (len(prompt) + n - 1, 64)
    hooks = install_replacement_hooks(pert, [name])
    calls = {"n": 0}

    def generate_fn(input_ids, use_replacement=True):
        calls["n"] += 1
        req = f"req-{calls['n']}"  # every retry is a new request
        replacer.register_request(req, input_ids[0])
        seq, rows = list(input_ids[0]), []
        with torch.no_grad():
            while len(rows) < n - (len(input_ids[0]) - len(prompt)):
                if use_replacement:
                    set_active_context(replacer.build_context([req], range(len(seq)), True))
                row = pert(torch.tensor([seq])).logits[0, -1]
                set_active_context(None)
                rows.append(row)
                seq.append(int(row.argmax()))
        return torch.stack(rows)[:, None]

    assert not logit_validation([prompt], lambda x: generate_fn(x, False), expected)
    calls["n"] = 0
    res = logit_validation([prompt], generate_fn, expected, return_details=True)
    assert res.passed and res.num_generate_calls == 1
    for h in hooks:
        h.remove()


def test_replacement_config_sources_and_errors(tmp_path):
    caps = [{"m": [torch.randn(1, 3, 2), torch.randn(1, 4, 2)]}]
    torch.save(caps, tmp_path / "t.pt")
    torch.save([torch.tensor([1, 2, 3])], tmp_path / "ids.pt")
    r = TensorReplacementConfig(
        tensors_path=str(tmp_path / "t.pt"), prompt_token_ids_path=str(tmp_path / "ids.pt")
    ).build_replacer()
    assert r.flat[0]["m"].shape == (4, 2)
    torch.testing.assert_close(r.flat[0]["m"][3], caps[0]["m"][1][0, 3])
    assert r.register_request("x", [1, 2, 3, 9]) == 0
    mem = TensorReplacementConfig(tensors=caps, prompt_token_ids=[[1, 2, 3]]).build_replacer()
    torch.testing.assert_close(mem.flat[0]["m"], r.flat[0]["m"])
    with pytest.raises(ValueError, match="unknown tensor_replacement keys"):
        TensorReplacementConfig.from_dict({"tensor_path": "x"})
    with pytest.raises(ValueError, match="does not exist"):
        TensorReplacementConfig(tensors_path=str(tmp_path / "nope.pt")).build_replacer()
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot load reference captures"):
        TensorReplacementConfig(tensors_path=str(tmp_path / "bad.safetensors")).build_replacer()
    with pytest.raises(ValueError, match="non-empty list"):
        TensorReplacer([])
    with pytest.raises(ValueError, match="1 prompts of token ids for 2"):
        TensorReplacer(caps * 2, prompt_token_ids=[[1]])
