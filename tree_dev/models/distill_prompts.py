"""Training prompts for a self-distilled draft of a pretrained chat model.

Two kinds, like the held-out set (``tree_dev.models.prompts``) but disjoint from it:

* ``chat``: questions built from task templates and topics (``TASKS`` x ``TOPICS``),
  rendered through the tokenizer's chat template;
* ``code``: the opening lines of functions and classes from the running interpreter's
  standard library (the held-out code prompts were written for that file, none from it).

The draft learns from the target's own answers to these prompts (self-distillation,
as EAGLE and Medusa-2 do): no outside text is needed, and the draft sees the target's
style, which is what it must predict.

    >>> texts = training_texts(8, seed=0)
    >>> sorted({kind for kind, _ in texts})
    ['chat', 'code']
"""

from __future__ import annotations

import ast
import functools
import random
import warnings

from .data import corpus_files, read_texts
from .prompts import heldout_texts

TASKS = (
    "Explain {t} to a beginner.",
    "What are the main ideas behind {t}?",
    "Write a short paragraph about {t}.",
    "Give three practical tips about {t}.",
    "What are common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.",
    "How would you teach {t} to a ten-year-old?",
    "List the pros and cons of {t}.",
    "Write a haiku about {t}.",
    "What questions should I ask before learning about {t}?",
    "Describe a real-world example of {t}.",
    "Compare {t} with something similar and explain the difference.",
    "Write a Python function related to {t}, with a docstring.",
    "What is the most important thing to know about {t}?",
    "Write a short story that involves {t}.",
    "Give me a step-by-step plan to get started with {t}.",
)

TOPICS = (
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "compound interest",
    "recursion",
    "linked lists",
    "the water cycle",
    "climate change",
    "vaccines",
    "machine learning",
    "the Roman Empire",
    "plate tectonics",
    "sourdough bread",
    "public speaking",
    "time management",
    "the stock market",
    "electric cars",
    "the human heart",
    "solar panels",
    "volcanoes",
    "the printing press",
    "sorting algorithms",
    "SQL joins",
    "version control with git",
    "unit testing",
    "regular expressions",
    "HTTP and web servers",
    "encryption",
    "prime numbers",
    "probability",
    "the Pythagorean theorem",
    "gardening",
    "meditation",
    "sleep",
    "marathon training",
    "chess openings",
    "jazz music",
    "the Renaissance",
    "democracy",
    "supply and demand",
    "inflation",
    "renewable energy",
    "the moon landing",
    "DNA",
    "evolution",
    "bees",
    "coral reefs",
    "rainforests",
    "the internet",
    "operating systems",
    "memory management",
    "databases",
    "cloud computing",
    "cybersecurity",
    "recycling",
    "learning a new language",
    "writing a resume",
    "job interviews",
    "budgeting",
    "healthy breakfast ideas",
    "coffee",
    "tea ceremonies",
    "ancient Egypt",
    "the Great Wall of China",
    "earthquakes",
    "the immune system",
    "gravity",
    "magnets",
    "rainbows",
    "the speed of light",
    "quantum computing",
    "binary numbers",
    "hash functions",
    "graph algorithms",
    "dynamic programming",
    "object-oriented programming",
    "functional programming",
    "the Python language",
    "JavaScript promises",
    "Rust ownership",
    "Linux file permissions",
    "friendship",
    "kindness",
    "traveling on a budget",
    "photography",
    "painting with watercolors",
    "the Olympic Games",
    "football",
    "birds migrating",
    "dinosaurs",
    "robots",
)


def chat_questions() -> list[str]:
    """Every template x topic question, in a fixed order."""
    return [task.format(t=topic) for topic in TOPICS for task in TASKS]


@functools.lru_cache(maxsize=2)
def code_openings(max_lines: int = 12) -> tuple[str, ...]:
    """The first lines (signature, docstring, start of the body) of every top-level
    function and class in the standard library's training split, sorted by file."""
    out = []
    train, _ = corpus_files()
    for text in read_texts(train):
        try:
            with warnings.catch_warnings():  # invalid escapes in old stdlib strings
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                body = lines[node.lineno - 1 : node.lineno - 1 + max_lines]
                snippet = "\n".join(body).rstrip() + "\n"
                if 3 <= len(body) and 80 <= len(snippet) <= 1200:
                    out.append(snippet)
    return tuple(out)


def training_texts(n: int, seed: int = 0, code_share: float = 0.4) -> list[tuple[str, str]]:
    """``n`` ``(kind, text)`` training prompts, ``code_share`` of them code, shuffled with
    ``seed``; none equal to a held-out prompt (``ValueError`` if the pools are short)."""
    rng = random.Random(seed)
    held = {text for _, text in heldout_texts()}
    chat = [q for q in chat_questions() if q not in held]
    code = [c for c in code_openings() if c not in held]
    n_code = round(n * code_share)
    if n_code > len(code) or n - n_code > len(chat):
        raise ValueError(
            f"n={n}: the pools have {len(chat)} chat questions and {len(code)} code openings"
        )
    picked = [("chat", q) for q in rng.sample(chat, n - n_code)]
    picked += [("code", c) for c in rng.sample(code, n_code)]
    rng.shuffle(picked)
    return picked
