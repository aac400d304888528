"""tree_dev.models: tokenizer, save/load, training, errors, committed checkpoint."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tree_dev.models import DEFAULT_CHECKPOINT, EagleHead, ModelSet, data, load
from tree_dev.models.evaluate import evaluate
from tree_dev.models.train import TINY, Logger, eagle_loss, save_lm, train_eagle, train_lm, val_loss

SAMPLE = [
    "def f(x):\n    return x + 1\n",
    'class A:\n    """Doc."""\n\n    def __init__(self):\n        self.a = {\'k\': [1, 2]}\n',
    "import os\nfor i in range(10):\n    print(i, os.sep)\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return data.train_tokenizer(SAMPLE, vocab_size=300)


@pytest.fixture(scope="module")
def tiny_stream(tok):
    texts = data.read_texts(data.corpus_files()[0][:6])
    return data.encode_stream(tok, texts)


def tiny_lm(tok, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(TINY.target.config(len(tok), TINY.seq_len, tok.eos_token_id)).eval()


@given(st.text(max_size=200))
def test_tokenizer_round_trips_and_counts_bytes(tok, s):
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    # bits per byte rely on this: the byte lengths of the tokens add up to the text's UTF-8 size.
    assert int(data.token_byte_lengths(tok)[ids].sum()) == len(s.encode("utf-8"))


@pytest.mark.parametrize(
    "s", ["", "  \t\n\r\n    x", "é漢字🙂\u200b\x00", "a <|endoftext|> b", "\ufeffcafé  "]
)
def test_tokenizer_round_trips_edge_cases(tok, s):
    assert tok.decode(tok.encode(s)) == s


def test_split_is_deterministic_and_disjoint():
    tr, va = data.corpus_files()
    tr2, va2 = data.corpus_files()
    assert tr == tr2 and va == va2
    assert not set(tr) & set(va)
    assert 0.02 < len(va) / (len(tr) + len(va)) < 0.10


def test_batches_deterministic_for_seed():
    s = torch.arange(1000)
    a, b, c = data.batches(s, 16, 4, 7), data.batches(s, 16, 4, 7), data.batches(s, 16, 4, 8)
    x, y, z = next(a), next(b), next(c)
    assert torch.equal(x, y) and not torch.equal(x, z)
    assert x.shape == (4, 17) and torch.equal(
        x[:, 1:] - x[:, :-1], torch.ones(4, 16, dtype=x.dtype)
    )


def test_save_load_identical_logits(tok, tmp_path):
    m = tiny_lm(tok)
    x = torch.randint(0, len(tok), (2, 20))
    ref = m(input_ids=x).logits
    save_lm(m, tok, tmp_path, "lm", torch.float32)
    m2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lm"), local_files_only=True)
    assert torch.equal(m2(input_ids=x).logits, ref)
    # bf16 storage, fp32 upcast on load: the logits of the bf16-rounded fp32 model.
    save_lm(m, tok, tmp_path, "lm16", torch.bfloat16)
    m3 = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "lm16"), dtype=torch.float32, local_files_only=True
    )
    assert m3.dtype == torch.float32
    torch.testing.assert_close(m3(input_ids=x).logits, m(input_ids=x).logits, rtol=0, atol=0)
    assert data.load_tokenizer(tmp_path / "lm").encode("def f(): pass") == tok.encode(
        "def f(): pass"
    )


def test_eagle_save_load_identical(tok, tmp_path):
    target = tiny_lm(tok)
    save_lm(target, tok, tmp_path, "target", torch.float32)
    head = EagleHead.from_target(target, seed=1)
    head.target_path = "../target"
    head.save_pretrained(tmp_path / "eagle")
    x = torch.randint(0, len(tok), (2, 12))
    h = target.model(input_ids=x).last_hidden_state
    ref = head(x, h)
    loaded = EagleHead.from_pretrained(tmp_path / "eagle")  # target found via config
    out = loaded(x, h)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(out.hidden_states, ref.hidden_states)
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and "last_hidden_state" in cfg["eagle"]["feature"]


def test_eagle_kv_cache_and_attention_interface(tok):
    target = tiny_lm(tok)
    head = EagleHead.from_target(target, seed=2).eval()
    x = torch.randint(0, len(tok), (1, 10))
    h = torch.randn(1, 10, target.config.hidden_size)
    pos = torch.arange(1, 11)[None]
    full = head(x, h, position_ids=pos).logits
    calls = []

    def counting(module, q, k, v, mask, **kw):
        calls.append(q.shape)
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("test_models_counting", counting)
    AttentionMaskInterface.register("test_models_counting", sdpa_mask)
    head.decoder.config._attn_implementation = "test_models_counting"
    cache = DynamicCache(config=head.config)
    a = head(x[:, :6], h[:, :6], position_ids=pos[:, :6], past_key_values=cache, use_cache=True)
    b = head(x[:, 6:], h[:, 6:], position_ids=pos[:, 6:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and calls[1][2] == 4  # the registered attention ran, on 4 new queries


def test_eagle_rejects_mismatched_inputs(tok):
    head = EagleHead.from_target(tiny_lm(tok))
    with pytest.raises(ValueError, match="disagree"):
        head(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, head.config.hidden_size))


def test_training_lowers_loss(tok, tiny_stream):
    recipe = replace(TINY, eval_every=1000, warmup=2)
    windows = data.eval_windows(tiny_stream, recipe.seq_len, 2)
    nbytes = data.token_byte_lengths(tok)
    target = tiny_lm(tok)
    before = val_loss(target, windows, nbytes)[0]
    hist = train_lm(target, tiny_stream, windows, nbytes, recipe, 3e-3, 0, 12, 0, Logger(None), "t")
    assert hist["steps"] == 12
    assert hist["val_loss"][-1] < before - 0.5, (before, hist["val_loss"])
    assert before == pytest.approx(math.log(len(tok)), abs=0.5)  # untrained = uniform-ish
    # EAGLE head on the trained target: its loss against the target's features falls.
    head = EagleHead.from_target(target, seed=0).float()

    def head_loss() -> float:
        with torch.no_grad():
            return float(eagle_loss(head, target, windows, 0.0)[0])

    start = head_loss()
    hist = train_eagle(head, target, tiny_stream, windows, recipe, 0, 10, 0, Logger(None))
    assert hist["steps"] == 10
    assert head_loss() < start - 0.3, (start, head_loss())


def test_evaluate_metrics_on_known_cases(tok):
    target = tiny_lm(tok, seed=3)
    head = EagleHead.from_target(target, seed=4).eval()
    text = "".join(SAMPLE[:3]) + "é漢字 🙂\n"
    ids = torch.tensor(tok.encode(text))
    windows = torch.stack([ids[:21], ids[20:41]])
    res = evaluate(ModelSet(target, target, head, tok, None), windows, data.token_byte_lengths(tok))
    t, d = res["target"], res["draft"]
    # a draft identical to the target agrees everywhere and has the same perplexity
    assert d["agree_top1"] == 1.0 and all(v == 1.0 for v in d["topk_hit"].values())
    assert d["ppl"] == pytest.approx(t["ppl"], rel=1e-6)
    # bytes are the UTF-8 size of the predicted text (positions 2 ..), bpb = nats / ln 2 / bytes
    nb = sum(len(tok.decode(w[2:]).encode()) for w in windows)
    assert t["bytes"] == nb and t["tokens"] == 2 * 19
    with torch.no_grad():
        logits = target(input_ids=windows[:, :-1]).logits[:, 1:]
    nats = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), windows[:, 2:].flatten(), reduction="sum"
    )
    assert t["bpb"] == pytest.approx(float(nats) / math.log(2) / nb, rel=1e-5)
    hits = [res["eagle"]["topk_hit"][k] for k in ("1", "2", "4", "8")]
    assert hits == sorted(hits) and hits[0] == res["eagle"]["agree_top1"]


def test_missing_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load(tmp_path / "nope")
    (tmp_path / "ck").mkdir()
    with pytest.raises(FileNotFoundError, match="target"):
        load(tmp_path / "ck")
    for sub in ("target", "draft", "eagle", "tokenizer"):
        (tmp_path / "ck" / sub).mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="eagle"):
        EagleHead.from_pretrained(tmp_path / "ck" / "eagle")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        data.load_tokenizer(tmp_path / "ck" / "tokenizer")
    with pytest.raises(FileNotFoundError, match="corpus root"):
        data.corpus_files(tmp_path / "absent")


def test_eagle_rejects_non_eagle_config(tok, tmp_path):
    target = tiny_lm(tok)
    target.save_pretrained(tmp_path / "t")
    (tmp_path / "t" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="eagle"):
        EagleHead.from_pretrained(tmp_path / "t", target=target)


COMMITTED = DEFAULT_CHECKPOINT / "eval_slice.json"


def test_committed_checkpoint_matches_recorded_metrics():
    assert COMMITTED.is_file(), (
        f"{COMMITTED} missing: run `python -m tree_dev.models eval --record 2`"
    )
    rec = json.loads(COMMITTED.read_text())
    m = load()
    assert m.target.dtype == torch.float32 and m.eagle.fc.weight.dtype == torch.float32
    assert len(m.tokenizer) == m.target.config.vocab_size == m.draft.config.vocab_size
    s = "def spam(eggs):\n    return {'ham': eggs}  # ünïcödé 🙂\n"
    assert m.tokenizer.decode(m.tokenizer.encode(s)) == s
    windows = load_file(str(DEFAULT_CHECKPOINT / "eval_slice.safetensors"))["windows"].long()
    assert windows.shape == (rec["windows"], rec["seq_len"] + 1)
    res = evaluate(m, windows, data.token_byte_lengths(m.tokenizer))
    for name, r in rec["models"].items():
        assert res[name]["tokens"] == r["tokens"] and res[name]["bytes"] == r["bytes"]
        assert res[name]["bpb"] == pytest.approx(r["bpb"], rel=1e-3)
        for k in ("agree_top1", "topk_hit"):
            if k in r:
                assert res[name][k] == pytest.approx(r[k], abs=2e-3)
    # and the slice is consistent with the goals (held-out text)
    assert res["target"]["bpb"] < 2.2
    assert res["eagle"]["topk_hit"]["8"] >= res["eagle"]["topk_hit"]["1"]


# ------------------------------------------------------------------ draft vocabulary
def test_eagle_draft_vocab_keeps_the_full_heads_logits_on_it_and_minus_inf_elsewhere(tok, tmp_path):
    target = tiny_lm(tok)
    save_lm(target, tok, tmp_path, "target", torch.float32)
    head = EagleHead.from_target(target, seed=1).eval()
    head.target_path = "../target"
    x = torch.randint(0, len(tok), (2, 12))
    h = target.model(input_ids=x).last_hidden_state
    with torch.no_grad():
        full = head(x, h).logits
        ids = torch.arange(3, len(tok), 5)
        head.restrict_vocab(ids)
        out = head(x, h)
    # reference: the full head's logits at the kept tokens, -inf at the others (fp32)
    want = torch.full_like(full, float("-inf"))
    want[..., ids] = full[..., ids]
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
    assert out.logits.shape == full.shape
    assert torch.isin(out.logits.argmax(-1), ids).all()
    assert head.lm_head.weight.shape == (len(ids), target.config.hidden_size)
    # what is stored and reloaded: the ids (int64), not the rows; same logits
    head.save_pretrained(tmp_path / "eagle")
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(ids)
    stored = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    assert torch.equal(stored["draft_vocab"], ids) and "lm_head.weight" not in stored
    loaded = EagleHead.from_pretrained(tmp_path / "eagle")
    assert torch.equal(loaded.draft_vocab, ids)
    with torch.no_grad():
        assert torch.equal(loaded(x, h).logits, out.logits)
    with pytest.raises(ValueError, match="already restricted"):
        loaded.restrict_vocab(ids)
    # a head without one stores neither
    plain = EagleHead.from_target(target, seed=1)
    plain.target_path = "../target"
    plain.save_pretrained(tmp_path / "plain")
    assert "draft_vocab_size" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert EagleHead.from_pretrained(tmp_path / "plain").draft_vocab is None


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.tensor([[1, 2]]), "1-D"),
        (torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.tensor([1.0, 2.0]), "integer"),
        (torch.tensor([1, 7, 5]), "entry 2 is 5 after 7"),
        (torch.tensor([1, 3, 3]), "entry 2 is 3 after 3"),
        (torch.tensor([0, 10_000]), "token 10000 outside"),
        (torch.tensor([-1, 4]), "token -1 outside"),
    ],
)
def test_eagle_bad_draft_vocab_is_refused_naming_it(tok, ids, match):
    head = EagleHead.from_target(tiny_lm(tok))
    with pytest.raises(ValueError, match=match):
        head.restrict_vocab(ids)
    assert head.draft_vocab is None


def test_eagle_draft_vocab_size_disagreeing_with_the_stored_ids_is_refused(tok, tmp_path):
    target = tiny_lm(tok)
    head = EagleHead.from_target(target)
    head.restrict_vocab(torch.arange(10))
    head.save_pretrained(tmp_path / "eagle")
    cfg_file = tmp_path / "eagle" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["draft_vocab_size"] = 11
    cfg_file.write_text(json.dumps(cfg))
    msg = "draft_vocab_size 11 but the weights hold a draft_vocab of 10"
    with pytest.raises(ValueError, match=msg):
        EagleHead.from_pretrained(tmp_path / "eagle", target=target)
