"""``serve.py --model smollm2-135m``: the real pretrained model served by name, both engines.

``--model NAME`` resolves through ``tree_dev.models.named`` (SmolLM2-135M-Instruct is
fetched into ``$TREESPEC_CACHE`` on first use: the ``smollm2_dir`` fixture of
conftest.py). Served by name it has the project's committed EAGLE head, so the default
is ``auto`` over that head's trees and the n-gram trie in both engines; by path, a plain
HF directory, ``auto`` over the n-gram tries. The end-to-end tests start one server at a time
(``serve.py`` in a subprocess, eager vLLM, 512 tokens of context) and ask it one
greedy chat question through the ``openai`` client; the reply must name Paris, and the
prompt must be the model's own ChatML chat template.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_serve_vllm import _free_port
from tree_dev.models.named import NAMED_MODELS
from tree_dev.server import config
from tree_dev.testing import server_process

pytestmark = pytest.mark.full  # make test-all only: servers on the real model

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m"
QUESTION = "What is the capital of France?"
ENGINES = [
    "local",
    pytest.param(
        "vllm",
        marks=pytest.mark.skipif(not config.vllm_installed(), reason="vLLM is not installed"),
    ),
]


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("engine", ENGINES)
def test_name_resolves_to_the_fetched_dir_served_with_auto(engine, smollm2_dir):
    from tree_dev.models.named import EAGLE_HEADS

    c = config.resolve_config(["--engine", engine, "--model", NAME])
    assert c.model == smollm2_dir and (c.model / "config.json").is_file()
    assert c.served_model_name == NAME and c.max_model_len == 8192
    # by name: auto over the model's committed EAGLE head (and the n-gram trie)
    assert (c.tree, c.drafter, c.drafter_path) == ("auto", "eagle", EAGLE_HEADS[NAME])
    assert c.tree_source == "default with the model's committed EAGLE head"
    # the same directory by path has no name, so no head: auto over the n-gram tries
    by_path = config.resolve_config(["--engine", engine, "--model", str(smollm2_dir)])
    assert (by_path.model, by_path.tree) == (c.model, "auto")
    assert (by_path.drafter, by_path.drafter_path) == ("ngram", None)
    assert by_path.tree_source == "default for a model without a draft"
    # plain decoding when asked; a tree that needs a draft is still an error
    plain = config.resolve_config(["--engine", engine, "--model", NAME, "--tree", "none"])
    assert (plain.tree, plain.drafter) == ("none", None)
    if engine == "vllm":  # its own tokenizer and ChatML template; the plugin's auto
        argv = config.vllm_argv(c)
        assert argv[argv.index("--model") + 1] == str(smollm2_dir)
        assert "--tokenizer" not in argv and "--chat-template" not in argv
        assert argv[argv.index("--served-model-name") + 1] == NAME
        assert config.vllm_speculative_config(c)["method"] == "eagle"
        assert config.vllm_speculative_config(by_path)["method"] == "ngram"
        assert config.vllm_additional_config(by_path) == {"treespec": {"tree": "auto"}}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tree_that_needs_a_draft_takes_the_models_committed_eagle_head(engine, smollm2_dir):
    from tree_dev.models.named import EAGLE_HEADS

    tree = "topk:k=2,depth=4,budget=8"
    c = config.resolve_config(["--engine", engine, "--model", NAME, "--tree", tree])
    assert (c.tree, c.drafter, c.drafter_path) == (tree, "eagle", EAGLE_HEADS[NAME])
    # the same checkpoint by path has no name, so no committed head: the tree is refused
    with pytest.raises(SystemExit):
        config.resolve_config(["--engine", engine, "--model", str(smollm2_dir), "--tree", tree])


@pytest.mark.parametrize("engine", ENGINES)
def test_stdlib_name_is_the_committed_set(engine):
    by_name = config.resolve_config(["--engine", engine, "--model", "stdlib-v1"])
    assert by_name == config.resolve_config(["--engine", engine])
    assert by_name.served_model_name == "stdlib-v1"


def test_unknown_model_name_is_a_startup_error_naming_the_known(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        config.resolve_config(["--engine", "local", "--model", "llama-9000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--model" in err and "llama-9000" in err
    assert all(name in err for name in NAMED_MODELS), err


# --------------------------------------------------------------------------- end to end
@contextlib.contextmanager
def _serve(engine: str, log: Path, *flags: str, timeout_s: float):
    """``python serve.py --engine ENGINE --model smollm2-135m ...`` on a free port; yields
    its base URL once ``/health`` answers (the pattern of test_serve_vllm.serve_vllm)."""
    port = _free_port()
    argv = [sys.executable, str(ROOT / "serve.py"), "--engine", engine, "--port", str(port)]
    argv += ["--model", NAME, "--max-model-len", "512", "--max-batch", "2", *flags]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with server_process(argv, log, env, ROOT, timeout_s) as base:
        yield base


def _ask_paris(base: str, model_dir: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    card = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == NAME and card["treespec"]["tree"] == "auto", card
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=16)
    reply = r.choices[0].message.content
    assert "Paris" in reply, reply
    # the prompt is the model's own ChatML template, not the plain fallback
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"), text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_local_engine_answers_a_chat_question(smollm2_dir, tmp_path):
    with _serve("local", tmp_path / "server.log", "--torch-threads", "2", timeout_s=240) as base:
        _ask_paris(base, smollm2_dir)


def test_vllm_engine_answers_a_chat_question(smollm2_dir, tmp_path):
    pytest.importorskip("vllm")
    log = tmp_path / "server.log"
    with _serve("vllm", log, "--enforce-eager", "--log-level", "warning", timeout_s=420) as base:
        _ask_paris(base, smollm2_dir)
