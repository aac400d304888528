"""Design-compatible module name: re-exports :mod:`accuracy.replacement`."""

from .replacement import (  # noqa: F401
    TensorReplacementConfig,
    TensorReplacer,
    get_replacement_tensor,
    install_replacement_hooks,
    set_active_context,
)
