"""Accuracy tooling: tensor capture, compare, replacement and logit validation.

Depends on nothing else in this project. See ``docs/accuracy.md``.
"""

from . import tensor_io
from .alignment import (
    align_and_truncate_hidden,
    align_decode_captures,
    default_reconstruction,
    hf_reference_reconstruction,
    llama_reconstruct,
)
from .capture import ModelCapture, TensorCaptureConfig, register_capture_hooks, setup_model_captures
from .compare import (
    AggregateMetrics,
    ComparisonResult,
    DynamicThresholdConfig,
    ThreeWayComparisonResult,
    bhattacharyya_coefficient,
    compare_captures_three_way,
    compare_captures_two_way,
    compare_tensors,
    compare_tensors_three_way,
    compute_aggregate_metrics,
)
from .logit_validation import LogitValidationResult, TokenValidation, logit_validation
from .patterns import expand_patterns, match_modules
from .plugin import TensorComparePlugin
from .registry import TensorRegistry, capture_tensor
from .replacement import (
    TensorReplacementConfig,
    TensorReplacer,
    get_replacement_tensor,
    install_replacement_hooks,
    set_active_context,
)
from .report import first_divergence, print_comparison_report, print_three_way_report
from .tensor_io import CapturedForwardPass, ForwardPassMetadata, TreeMetadata
from .tree_compare import (
    TreeNodeComparison,
    TreeNodePair,
    compare_tree_with_dense,
    errors_by_depth,
    pair_tree_nodes_with_dense_steps,
    print_tree_report,
)
from .writer import CaptureWriter

__all__ = [
    "AggregateMetrics",
    "CaptureWriter",
    "CapturedForwardPass",
    "ComparisonResult",
    "DynamicThresholdConfig",
    "ForwardPassMetadata",
    "LogitValidationResult",
    "ModelCapture",
    "TensorCaptureConfig",
    "TensorComparePlugin",
    "TensorRegistry",
    "TensorReplacementConfig",
    "TensorReplacer",
    "ThreeWayComparisonResult",
    "TokenValidation",
    "TreeMetadata",
    "TreeNodeComparison",
    "TreeNodePair",
    "align_and_truncate_hidden",
    "align_decode_captures",
    "bhattacharyya_coefficient",
    "capture_tensor",
    "compare_captures_three_way",
    "compare_captures_two_way",
    "compare_tensors",
    "compare_tensors_three_way",
    "compare_tree_with_dense",
    "compute_aggregate_metrics",
    "default_reconstruction",
    "errors_by_depth",
    "expand_patterns",
    "first_divergence",
    "get_replacement_tensor",
    "hf_reference_reconstruction",
    "install_replacement_hooks",
    "llama_reconstruct",
    "logit_validation",
    "match_modules",
    "pair_tree_nodes_with_dense_steps",
    "print_comparison_report",
    "print_three_way_report",
    "print_tree_report",
    "register_capture_hooks",
    "set_active_context",
    "setup_model_captures",
    "tensor_io",
]
