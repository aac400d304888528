"""The self-distilled EAGLE head's pieces (``tree_dev.models.distill``), on the toy set.

The acceptance measure is checked against a step-by-step recomputation without any
cache; the training loop must beat an untrained head on sequences it never saw.
"""

from __future__ import annotations

import json

import pytest
import torch

from tree_dev.models import EagleHead, load
from tree_dev.models.data import corpus_files, read_texts
from tree_dev.models.distill import (
    _ragged,
    _unragged,
    _windows,
    chain_acceptance,
    load_cached,
    reduced_vocab,
    target_features,
    target_reference,
    train_head,
)
from tree_dev.models.distill_prompts import chat_questions, training_texts
from tree_dev.models.eagle import save_safetensors_atomic
from tree_dev.models.prompts import heldout_texts


@pytest.fixture(scope="module")
def toy():
    torch.set_num_threads(1)
    return load()


@pytest.fixture(scope="module")
def toy_text(toy):
    """Held-out standard-library files of the toy set, as 200-token sequences."""
    _, val = corpus_files()
    seqs = [toy.tokenizer.encode(t)[:200] for t in read_texts(val[:24])]
    return [s for s in seqs if len(s) == 200]


def _greedy(target, prompts, n):
    with torch.no_grad():
        return [
            target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def test_training_prompts_are_seeded_mixed_and_never_held_out():
    a, b = training_texts(300, seed=0), training_texts(300, seed=0)
    assert a == b and a != training_texts(300, seed=1)
    held = {text for _, text in heldout_texts()}
    assert not held & {text for _, text in a}
    kinds = [k for k, _ in a]
    assert kinds.count("code") == 120 and kinds.count("chat") == 180
    assert len(set(chat_questions())) == len(chat_questions())
    with pytest.raises(ValueError, match="n=100000: the pools have"):
        training_texts(100000)


def test_packing_and_windows_cover_every_position_once():
    seqs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11]]
    packed = _ragged(seqs)
    assert _unragged(packed["ids"], packed["offsets"]) == seqs
    spans = _windows(packed["offsets"].tolist(), 3)
    # windows of <= 4 positions, overlapping by one (the next window's first input is the
    # previous one's last label), never across sequences, none of a 1-token sequence
    assert spans == [(0, 3), (4, 8), (7, 11)]


def test_a_cached_stage_is_reused_only_for_the_same_settings(tmp_path):
    path = tmp_path / "answers.safetensors"
    assert load_cached(path, {"n_prompts": 8}) is None  # nothing cached yet
    save_safetensors_atomic({"ids": torch.arange(4)}, path, {"n_prompts": 8, "seed": 0})
    assert load_cached(path, {"n_prompts": 8, "seed": 0})["ids"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cached for n_prompts=8, this run asks n_prompts=16"):
        load_cached(path, {"n_prompts": 16, "seed": 0})


def test_reduced_vocab_keeps_the_most_frequent_and_the_forced_tokens():
    labels = torch.tensor([5, 5, 5, 7, 7, 9, 1], dtype=torch.int32)
    assert reduced_vocab(labels, 2, [0]).tolist() == [0, 5, 7]
    assert reduced_vocab(labels, 10, []).tolist() == [1, 5, 7, 9]  # never a token never seen


def test_batched_features_equal_one_sequence_forwards(toy, toy_text):
    seqs = [s[: 40 + 30 * i] for i, s in enumerate(toy_text[:4])]
    got = target_features(toy.target, seqs, max_tokens_per_batch=150)  # several padded batches
    off = 0
    with torch.no_grad():
        for s in seqs:
            h = toy.target.model(input_ids=torch.tensor([s])).last_hidden_state[0]
            # fp16 storage: ~1e-3 relative on features of magnitude ~1
            torch.testing.assert_close(
                got["features"][off : off + len(s)].float(), h, rtol=2e-3, atol=2e-3
            )
            assert got["argmax"][off : off + len(s)].tolist() == (
                toy.target.lm_head(h).argmax(-1).tolist()
            )
            off += len(s)
    assert off == len(got["argmax"])


def test_chain_acceptance_equals_a_cache_free_recomputation(toy, toy_text):
    prompts = [s[:48] for s in toy_text[:3]]
    answers = _greedy(toy.target, prompts, 12)
    got = chain_acceptance(toy.eagle, toy.target, prompts, answers, depth=4)
    acc, n = [0] * 4, 0
    with torch.no_grad():
        for p, a in zip(prompts, answers):
            seq = p + a
            h = toy.target.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            for t in range(len(p), len(seq) - 1):
                n += 1
                ids, feats = list(seq[1 : t + 1]), [h[i] for i in range(t)]
                for k in range(4):
                    if t + 1 + k >= len(seq):
                        break
                    out = toy.eagle(
                        torch.tensor([ids]),
                        torch.stack(feats)[None],
                        position_ids=torch.arange(1, len(ids) + 1)[None],
                    )
                    tok = int(out.logits[0, -1].argmax())
                    if tok != seq[t + 1 + k]:
                        break
                    acc[k] += 1
                    ids.append(tok)
                    feats.append(out.hidden_states[0, -1])
    assert got["positions"] == n
    assert got["accept_per_depth"] == pytest.approx([c / n for c in acc])
    assert got["tau_chain4"] == pytest.approx(1 + sum(c / n for c in acc))
    assert got["tau_chain4"] > 1.5  # the committed head drafts; a broken one would not
    broken = EagleHead.from_target(toy.target, seed=3)
    assert chain_acceptance(broken, toy.target, prompts, answers)["tau_chain4"] < 1.2


def test_train_head_beats_an_untrained_head_on_unseen_text(toy, toy_text):
    train, held = toy_text[:16], toy_text[16:]
    data = {**_ragged(train), **target_features(toy.target, train)}
    vocab = reduced_vocab(data["argmax"], 512, [])
    head = EagleHead.from_target(toy.target, seed=0)
    prompts = [s[:64] for s in held]
    answers = _greedy(toy.target, prompts, 16)
    before = chain_acceptance(head, toy.target, prompts, answers)["agree1"]
    hist = train_head(head, data, vocab, minutes=0.25, seq_len=64, batch=8, eval_every=20)
    after = chain_acceptance(head, toy.target, prompts, answers)["agree1"]
    assert len(hist["step"]) >= 3 and hist["loss"][-1] < hist["loss"][0]
    # validation agreement (depth 1, depth 2) rose, and the head kept its best weights
    assert sum(hist["val_agree"][-1]) > sum(hist["val_agree"][0])
    assert hist["best_step"] in hist["step"]
    assert after > before + 0.2, (before, after)


def test_a_head_names_its_target_by_model_name(toy, tmp_path, monkeypatch):
    from tree_dev.models import named

    monkeypatch.setitem(named.NAMED_MODELS, "toy-target", toy.path / "target")
    head = EagleHead.from_target(toy.target, seed=0)
    head.target_path = "named:toy-target"
    head.save_pretrained(tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["eagle"]["target"] == (
        "named:toy-target"
    )
    loaded = EagleHead.from_pretrained(tmp_path / "head")  # the target found by its name
    assert torch.equal(loaded.lm_head.weight, toy.target.lm_head.weight)
    head.target_path = "named:no-such-model"
    head.save_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError, match="no-such-model"):
        EagleHead.from_pretrained(tmp_path / "bad")


def test_a_head_names_a_named_target_by_name_and_a_directory_by_absolute_path(tmp_path):
    assert target_reference("smollm2-135m", tmp_path) == "named:smollm2-135m"
    (tmp_path / "m").mkdir()
    rel = tmp_path / "m" / ".." / "m"
    assert target_reference(str(rel), rel) == str((tmp_path / "m").resolve())
