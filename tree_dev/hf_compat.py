"""Differences between the ``transformers`` releases the project runs on.

vLLM 0.32 pins ``transformers < 5.20``, where a model's ``forward`` takes its KV cache as
``past_key_values``; releases from 5.2x on call it ``cache``. ``cache_kwargs`` names it
the way the installed release does.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def cache_keyword() -> str:
    """``"cache"`` or ``"past_key_values"``: how ``LlamaModel.forward`` takes its cache."""
    from transformers import LlamaModel

    params = inspect.signature(LlamaModel.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{cache_keyword(): cache}``, to splat into a Hugging Face model call."""
    return {cache_keyword(): cache}
