"""Corpus, tokenizer and packed token streams for the tiny model pair.

The corpus is the running interpreter's standard-library source: every ``*.py``
file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded) that
decodes as UTF-8.  The held-out split is deterministic: a file is validation
when ``sha256(relative posix path)`` modulo 100 is below ``VAL_PERCENT``.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the training
split, wrapped as a ``transformers.PreTrainedTokenizerFast``.  No normalizer,
no prefix space and the byte-level decoder, so ``decode(encode(s)) == s`` for
every string ``s``.  Bits per byte are computed per UTF-8 byte of raw text with
:func:`token_byte_lengths`.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch

VAL_PERCENT = 5
EOS = "<|endoftext|>"


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """``(train, val)`` lists of ``.py`` files under ``root`` (sorted, deterministic)."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    train, val = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or not path.is_file():
            continue
        h = int(hashlib.sha256(rel.encode()).hexdigest(), 16)
        (val if h % 100 < VAL_PERCENT else train).append(path)
    return train, val


def read_texts(files: list[Path]) -> list[str]:
    """UTF-8 contents of ``files``; files that are not valid UTF-8 are skipped."""
    out = []
    for f in files:
        try:
            out.append(f.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Byte-level BPE over ``texts`` -> ``PreTrainedTokenizerFast`` (eos/bos/pad = EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer saved by ``save_pretrained``; clear error when absent."""
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    if not (p / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {p}")
    return PreTrainedTokenizerFast.from_pretrained(str(p))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """``int64[vocab]``: UTF-8 bytes each token id stands for (special tokens: 0)."""
    inv = {u: b for b, u in _bytes_to_unicode().items()}
    n = len(tokenizer)
    out = torch.zeros(n, dtype=torch.int64)
    special = set(tokenizer.all_special_ids)
    for tid in range(n):
        if tid in special:
            continue
        s = tokenizer.convert_ids_to_tokens(tid)
        out[tid] = sum(1 for ch in s if ch in inv)
    return out


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized and concatenated, each followed by EOS: ``int64[T]``."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for e in enc:
        ids.extend(e)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def batches(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
    """Infinite iterator of packed ``int64[batch_size, seq_len + 1]`` windows.

    Windows start at random offsets drawn from a ``torch.Generator`` seeded with
    ``seed``, so the sequence of batches is a deterministic function of it.
    """
    if stream.numel() <= seq_len + 1:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than seq_len + 1")
    g = torch.Generator().manual_seed(seed)
    hi = stream.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, hi, (batch_size,), generator=g)
        yield torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int | None = None):
    """Non-overlapping ``int64[W, seq_len + 1]`` windows covering the stream's start."""
    n = (stream.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError("validation stream shorter than one window")
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
