"""Held-out prompts for real pretrained models (``heldout_prompts.json``).

25 code prompts (written for the file, none from the standard library the toy set was
trained on) fed raw, and 25 chat questions rendered through the tokenizer's chat
template, interleaved so that any prefix of the list mixes both kinds.

    >>> from transformers import AutoTokenizer  # doctest: +SKIP
    >>> ids = heldout_prompt_ids(AutoTokenizer.from_pretrained(DIR), 6)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("heldout_prompts.json")


def heldout_texts(n: int | None = None) -> list[tuple[str, str]]:
    """``[(kind, text)]``, kind ``"code"`` or ``"chat"``, alternating; at most ``n``."""
    data = json.loads(PROMPTS_FILE.read_text())
    code, chat = data["code"], data["chat"]
    mixed = [p for pair in zip(code, chat) for p in (("code", pair[0]), ("chat", pair[1]))]
    mixed += [("code", c) for c in code[len(chat) :]] + [("chat", c) for c in chat[len(code) :]]
    if n is not None and not 0 < n <= len(mixed):
        raise ValueError(f"n={n}: the held-out set has {len(mixed)} prompts")
    return mixed[:n]


def heldout_prompt_ids(tokenizer, n: int | None = None) -> list[list[int]]:
    """Token ids of the first ``n`` held-out prompts; chat ones through the chat template."""
    out = []
    for kind, text in heldout_texts(n):
        if kind == "chat":
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5: an encoding
                ids = ids["input_ids"]
            out.append(list(ids))
        else:
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out
