"""Design-compatible module name: re-exports :mod:`accuracy.alignment`."""

from .alignment import (  # noqa: F401
    align_and_truncate_hidden,
    align_decode_captures,
    default_reconstruction,
    hf_reference_reconstruction,
    llama_reconstruct,
    num_real_tokens,
)
