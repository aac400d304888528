"""serve.py's flags: one tree policy from vLLM's, SGLang's or the project's own words.

``resolve_config(argv)`` parses the command line, maps ``--speculative-config`` /
``--additional-config`` (vLLM) and ``--speculative-eagle-topk`` & co. (SGLang) onto a
tree spec string (``tree_dev.spec``) and a drafter, applies the defaults of the chosen
engine (``--engine local|vllm``) and checks everything before any model is loaded:
contradictory flags, a bad tree, or ``--max-model-len`` above the model's
``max_position_embeddings`` exit with status 2 (argparse) naming the flags / numbers.
``--model`` takes a directory or a model name of ``tree_dev.models.named``
(``stdlib-v1``, ``smollm2-135m``: fetched on first use), resolved here for both engines.
``vllm_argv(cfg)`` is the command line of vLLM's own OpenAI server for a config.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tree_dev.models.named import eagle_head_dir
from tree_dev.spec import (
    DRAFT_OF_VLLM_METHOD,
    AutoTreePolicy,
    TreeSettings,
    is_ngram,
    parse_tree_spec,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_SET = REPO / "checkpoints" / "stdlib-v1"
#: The gates report each engine's server reads at start-up (``python -m bench.gates``).
GATES_REPORTS = {
    "local": REPO / "results" / "gates.json",
    "vllm": REPO / "results" / "gates_vllm.json",
}
ENGINES = ("local", "vllm")
# The serving defaults are code, not benchmark output: the same flags serve the same policy
# on every machine. ``--tree-from REPORT.json`` serves a report's measured best instead.
# Why, with the figures: docs/serve.md ("Default policies").
#: The tree of every default, both engines, wherever a draft or a trie is available:
#: ``auto`` chooses per step and request the tree, or none, of the best expected tokens per
#: second, so a server with speculation on is not slower where drafts do not pay. Its
#: draft: a model set's EAGLE head (else its draft LM), a named model's committed EAGLE
#: head, the draft flag given; with none of them, its n-gram tries alone.
DEFAULT_TREE = "auto"
#: vLLM speculative methods -> the drafter kind they use (the core's, and ``eagle3``; a
#: drafter kind maps back to its method through ``tree_dev.spec.VLLM_METHOD``).
VLLM_METHODS = {**DRAFT_OF_VLLM_METHOD, "eagle3": "eagle"}
SGLANG_ALGORITHMS = {"EAGLE": "eagle", "EAGLE3": "eagle", "STANDALONE": "draft", "NGRAM": "ngram"}
#: ASGI middleware (an import path) that vLLM's server loads to describe the policy.
VLLM_MODELS_MIDDLEWARE = "tree_dev.server.vllm_front.treespec_models"
#: ASGI middleware that adds ``tree: auto``'s statistics to vLLM's ``/metrics`` (auto only).
VLLM_METRICS_MIDDLEWARE = "tree_dev.server.vllm_front.treespec_metrics"

#: The chat template of a tokenizer without one (the tiny stdlib tokenizer), in both
#: engines: every message as ``"{role}: {content}\n"``, then ``"assistant:"``.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

log = logging.getLogger("treespec.serve")


@dataclass
class ServeConfig:
    """Everything ``main`` needs, after flag mapping and defaults.

    ``drafter`` is ``"eagle"``, ``"draft"`` (a small LM), ``"ngram"`` (no model: the n-gram
    trie, or ``auto`` choosing among tries) or ``None`` (``tree == "none"``).
    ``speculative_extra`` / ``additional_extra`` are the keys of vLLM's
    ``--speculative-config`` / ``--additional-config`` that are passed to vLLM as they
    are (the local engine ignores them); ``vllm_args`` are the words after ``--`` on the
    command line, appended to vLLM's.
    """

    model: Path
    tokenizer: Path | None
    drafter: str | None
    drafter_path: Path | None
    tree: str
    tree_source: str  # which flag (or default) chose the tree
    max_model_len: int
    engine: str = "local"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    kernel_backend: str = "auto"
    served_model_name: str = "treespec"
    dtype: str = "float32"
    device: str = "auto"
    torch_threads: int | None = None
    gates_report: Path = GATES_REPORTS["local"]
    log_level: str = "info"
    enforce_eager: bool = False
    draft_sampling: bool = False
    tensor_parallel_size: int = 1
    speculative_extra: dict[str, Any] = field(default_factory=dict)
    additional_extra: dict[str, Any] = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)

    def info(self) -> dict[str, Any]:
        """What ``/v1/models`` says about the policy (``treespec`` field of the card)."""
        return {
            "engine": self.engine,
            "tree": self.tree,
            "tree_source": self.tree_source,
            "drafter": self.drafter,
            "drafter_path": str(self.drafter_path) if self.drafter_path else None,
            "model": str(self.model),
            "max_model_len": self.max_model_len,
            "kernel_backend": self.kernel_backend,
            "draft_sampling": self.draft_sampling,
        }


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_plugin_available() -> bool:
    """Whether the project's vLLM tree plugin (``tree_dev.vllm_plugin.hooks``) exists."""
    try:
        return importlib.util.find_spec("tree_dev.vllm_plugin.hooks") is not None
    except ImportError:
        return False


def default_engine() -> str:
    """``"vllm"`` where vLLM is installed, else ``"local"``."""
    return "vllm" if vllm_installed() else "local"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py",
        description="OpenAI-compatible server with tree speculative decoding over the "
        "local engine or vLLM. Words after -- are passed to vLLM's server (--engine vllm).",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        help="local: the project's engine; vllm: vLLM's own OpenAI server with the tree "
        f"plugin (default: {default_engine()}, i.e. vllm where it is installed)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help="a model name (stdlib-v1: the committed toy set; smollm2-135m: SmolLM2-135M-"
        "Instruct, fetched on first use), a target checkpoint directory, or a model set "
        "directory with target/, eagle/, draft/, tokenizer/ "
        f"(default: {DEFAULT_MODEL_SET.relative_to(REPO)})",
    )
    g.add_argument("--draft-model", type=Path, help="a small causal LM as the draft")
    g.add_argument("--eagle-head", type=Path, help="an EAGLE head as the draft")
    g.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: found)")
    g.add_argument(
        "--served-model-name",
        help="model id in the API (default: the model name, else the model (set) dir's name)",
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="local: cpu, cuda, cuda:1 ... (auto: cuda)")
    t = p.add_argument_group("tree policy")
    t.add_argument(
        "--tree",
        help="tree spec: none, chain:K, paths:[...], medusa:NAME, topk:..., ngram:..., "
        "hybrid:..., or auto (per step and request the tree, or none, of the best expected "
        "tokens per second; auto:TREE;TREE;... lists its candidates; the default wherever "
        "a draft or an n-gram trie is available)",
    )
    t.add_argument(
        "--tree-from",
        type=Path,
        metavar="REPORT.json",
        help="serve the best policy a benchmark measured: results/e2e.json of python -m "
        "bench.e2e (--engine local) or results/vllm_e2e.json of python -m bench.vllm_e2e "
        "(--engine vllm); without it the defaults are fixed in code",
    )
    t.add_argument(
        "--speculative-config",
        help="vLLM's JSON: method (draft_model, eagle, eagle3, ngram), model, "
        "num_speculative_tokens, speculative_token_tree, other vLLM keys",
    )
    t.add_argument(
        "--additional-config",
        help='vLLM\'s JSON; {"treespec": {"tree": SPEC}} sets the tree (the plugin\'s key)',
    )
    t.add_argument(
        "--draft-sampling",
        action="store_true",
        help="sampled requests: draw a static tree's children from the draft (Gumbel top-k) "
        "and verify them with the residual rule (both engines; the plugin's "
        '"draft_sampling" key)',
    )
    t.add_argument("--speculative-algorithm", help="SGLang: EAGLE, EAGLE3, STANDALONE or NGRAM")
    t.add_argument("--speculative-draft-model-path", type=Path, help="SGLang: the draft")
    t.add_argument("--speculative-eagle-topk", type=int, help="SGLang: k of the top-K tree")
    t.add_argument("--speculative-num-steps", type=int, help="SGLang: depth of the tree")
    t.add_argument(
        "--speculative-num-draft-tokens", type=int, help="SGLang: tree nodes incl. the root"
    )
    s = p.add_argument_group("server")
    s.add_argument("--kernel-backend", default="auto", help="auto, torch, triton, nki, reference")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=16, help="most requests decoded together")
    s.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output (default: the target's max_position_embeddings)",
    )
    s.add_argument("--torch-threads", type=int, help="local: torch.set_num_threads")
    s.add_argument("--enforce-eager", action="store_true", help="vllm: no torch.compile")
    s.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vllm: TP ranks (on CPU each rank gets its own cores unless "
        "VLLM_CPU_OMP_THREADS_BIND is set)",
    )
    s.add_argument(
        "--gates-report",
        type=Path,
        help="stage gates report (default: results/gates.json for local, "
        "results/gates_vllm.json for vllm)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


# --------------------------------------------------------------------------- tree kinds
def auto_policy(tree: str | None) -> AutoTreePolicy | None:
    """``tree`` parsed when it is ``auto`` or ``auto:TREE;...``, else None (a spec that does
    not parse too: its parse names the error where the flag is checked)."""
    if tree is None:
        return None
    try:
        policy = parse_tree_spec(tree)
    except ValueError:
        return None
    return policy if isinstance(policy, AutoTreePolicy) else None


def trie_only(tree: str | None) -> bool:
    """Whether ``tree`` drafts only from the text itself (the ``"ngram"`` draft, never a
    model, whatever the model set holds): an n-gram trie, or ``auto:...`` listing only
    tries."""
    if is_ngram(tree):
        return True
    auto = auto_policy(tree)
    return auto is not None and auto.given and not auto.needs_model


def runs_without_model(tree: str | None) -> bool:
    """Whether ``tree`` runs on a checkpoint with no draft model: ``none``, a trie-only tree
    (``trie_only``), or ``auto`` with its default candidates (then its n-gram tries)."""
    auto = auto_policy(tree)
    return tree == "none" or trie_only(tree) or (auto is not None and not auto.given)


# --------------------------------------------------------------------------- best policies
def read_best_policy(path: Path) -> tuple[str, str]:
    """``(tree spec, where it came from)``: ``best_policy`` of a ``bench.e2e`` report.

    ``best_policy`` may be a spec string or an object with a ``tree`` (or ``spec``) key
    and optionally ``drafter`` (``"eagle"`` or ``"draft"``, see ``read_best_drafter``).
    Raises ``ValueError`` naming the file and what is wrong with it.
    """
    from tree_dev.spec import parse_tree_spec

    try:
        best = json.loads(Path(path).read_text())["best_policy"]
        spec = best if isinstance(best, str) else best.get("tree") or best.get("spec")
        parse_tree_spec(spec)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report (python -m bench.e2e writes one)") from None
    except (KeyError, TypeError, AttributeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} has no valid best_policy ({e})") from None
    return spec, f"best_policy of {path}"


def read_best_drafter(path: Path) -> str | None:
    """``"eagle"`` or ``"draft"`` when ``best_policy`` is an object naming its ``drafter``."""
    try:
        best = json.loads(Path(path).read_text())["best_policy"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None
    kind = best.get("drafter") if isinstance(best, dict) else None
    return kind if kind in ("eagle", "draft") else None


def read_best_vllm_policy(path: Path) -> tuple[str | None, str, str, bool]:
    """``(drafter kind or None, tree spec, source, sampled drafts)`` of vLLM's best
    measured policy in a ``bench.vllm_e2e`` report.

    Its ``best_policy`` object (``method``: a vLLM method, ``tree``: a spec, optionally
    ``draft_sampling``) when it has one, else its ``summary`` for greedy batch 1
    (``"batch1 T=0.0"``): the faster of the best tree and the best vLLM method, by their
    ratio to vLLM plain. A tree other than a chain needs the plugin. Raises ``ValueError``
    naming the file and what is wrong with it.
    """
    try:
        doc = json.loads(Path(path).read_text())
        best = doc.get("best_policy")
        if best is not None:
            method, spec = best["method"], best["tree"]
            sampled = bool(best.get("draft_sampling", False))
        else:
            s = doc["summary"]["batch1 T=0.0"]
            key = "best_tree" if s["best_tree_ratio"] >= s["best_builtin_ratio"] else "best_builtin"
            method, spec, sampled = _vllm_e2e_name(s[key])
        settings = TreeSettings.parse(spec, sampled)
        if method is not None and method not in VLLM_METHODS:
            raise ValueError(f"unknown method {method!r}")
        if settings.uses_plugin and not vllm_plugin_available():
            raise ValueError(f"tree {spec!r} needs the tree plugin, which is not installed")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report (python -m bench.vllm_e2e writes one)") from None
    except (KeyError, TypeError, ValueError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} has no usable best policy ({e})") from None
    kind_of = VLLM_METHODS[method] if method else None
    return kind_of, spec, f"best measured in {path}", sampled


def _measured_policy(
    parser: argparse.ArgumentParser, report: Path | None, engine: str, other_flag: str | None
) -> tuple[str | None, str, str, bool] | None:
    """``--tree-from REPORT``: ``(drafter kind or None, tree, source, sampled drafts)`` of the
    report's best policy for ``engine``, or None without the flag. A report that is missing
    or has no usable best policy, or a tree or draft flag beside it, is a flag error."""
    if report is None:
        return None
    if other_flag is not None:
        parser.error(
            f"argument --tree-from: not allowed with {other_flag} (the report chooses the "
            "tree and its draft)"
        )
    try:
        if engine == "vllm":
            return read_best_vllm_policy(report)
        spec, source = read_best_policy(report)
    except ValueError as e:
        parser.error(f"argument --tree-from: {e}")
    kind = "ngram" if trie_only(spec) else read_best_drafter(report)
    return kind, spec, source, False


def _vllm_e2e_name(name: str) -> tuple[str | None, str, bool]:
    """``bench.vllm_e2e``'s configuration names -> ``(vLLM method or None, tree spec,
    sampled drafts)``: ``"tree METHOD SPEC [sampled drafts]"``, ``"vllm plain"``,
    ``"vllm METHOD [chain] k=K"``."""
    words = name.split()
    sampled = words[-2:] == ["sampled", "drafts"]
    if sampled:
        words = words[:-2]
    if words[:1] == ["tree"] and len(words) == 3:
        return words[1], words[2], sampled
    if words == ["vllm", "plain"] and not sampled:
        return None, "none", False
    if words[:1] == ["vllm"] and words[-1].startswith("k=") and not sampled:
        return words[1], f"chain:{int(words[-1][2:])}", False
    raise ValueError(f"unknown configuration name {name!r}")


def max_position_embeddings(model_dir: Path) -> int | None:
    """``max_position_embeddings`` of a checkpoint's ``config.json`` (None if absent)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


# --------------------------------------------------------------------------- flag mapping
class _FlagError(Exception):
    pass


def _json_flag(flag: str, raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _FlagError(f"argument {flag}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise _FlagError(f"argument {flag}: expected a JSON object")
    return value


def _additional_config(raw: str) -> tuple[str | None, bool, dict[str, Any]]:
    """vLLM ``--additional-config`` -> (tree spec of its ``treespec`` key or None, its
    ``draft_sampling``, the rest)."""
    flag = "--additional-config"
    ac = _json_flag(flag, raw)
    ts = ac.pop("treespec", None)
    if ts is None:
        return None, False, ac
    if not isinstance(ts, dict) or not isinstance(ts.get("tree"), str):
        raise _FlagError(f'argument {flag}: "treespec" must be an object with a "tree" string')
    unknown = sorted(set(ts) - {"tree", "draft_sampling"})
    if unknown:
        raise _FlagError(f'argument {flag}: unknown key(s) {unknown} in "treespec"')
    sampling = ts.get("draft_sampling", False)
    if not isinstance(sampling, bool):
        raise _FlagError(f'argument {flag}: "treespec" "draft_sampling" must be true or false')
    return ts["tree"], sampling, ac


def _vllm_speculative_config(
    raw: str, plugin_tree: str | None
) -> tuple[str | None, tuple[str, Path | None] | None, dict[str, Any]]:
    """vLLM ``--speculative-config`` -> (tree spec or None, (drafter, path) or None, extra keys).

    ``plugin_tree`` is the tree of ``--additional-config``'s ``treespec`` key: then
    ``num_speculative_tokens`` is its draft-node budget and must equal it.
    """
    flag = "--speculative-config"
    sc = _json_flag(flag, raw)
    method, model = sc.pop("method", None), sc.pop("model", None)
    k = sc.pop("num_speculative_tokens", None)
    tree_raw = sc.pop("speculative_token_tree", None)
    if method is None:
        method = "draft_model" if model else None
    if method is not None and method not in VLLM_METHODS:
        raise _FlagError(
            f"argument {flag}: method {method!r} is not supported; use one of "
            f"{sorted(VLLM_METHODS)}"
        )
    drafter = _vllm_drafter(flag, method, model)
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise _FlagError(f"argument {flag}: num_speculative_tokens must be an integer >= 1")
    if plugin_tree is not None:
        _check_plugin_budget(flag, plugin_tree, k, tree_raw, drafter[0] if drafter else None)
        return None, drafter, sc
    if tree_raw is not None:
        return _token_tree_spec(flag, tree_raw, k), drafter, sc
    if k is not None:
        return f"chain:{k}", drafter, sc
    return None, drafter, sc


def _vllm_drafter(flag: str, method: str | None, model: Any) -> tuple[str, Path | None] | None:
    """``(drafter kind, path)`` of vLLM's speculative method and model (None: neither)."""
    if method == "ngram":
        if model is not None:
            raise _FlagError(f"argument {flag}: method 'ngram' takes no 'model'")
        return ("ngram", None)
    if model is not None:
        if not isinstance(model, str) or not model:
            raise _FlagError(f"argument {flag}: 'model' must be a path string")
        return (VLLM_METHODS[method], Path(model))
    if method is not None:
        raise _FlagError(f"argument {flag}: method {method!r} needs a 'model'")
    return None


def _check_plugin_budget(
    flag: str, plugin_tree: str, k: int | None, tree_raw: Any, draft: str | None
) -> None:
    """With the plugin's tree, ``num_speculative_tokens`` is its budget; no vLLM tree.
    ``draft``: the kind of ``--speculative-config``'s method, which resolves ``auto``'s
    candidates (and so its budget: the largest one's)."""
    if tree_raw is not None:
        raise _FlagError(
            f"argument {flag}: speculative_token_tree not allowed with "
            "--additional-config's treespec tree"
        )
    try:
        if draft is not None and auto_policy(plugin_tree) is not None:
            field = f"--speculative-config's {draft!r} draft"
            settings = TreeSettings.parse(plugin_tree, draft=draft, draft_field=field)
        else:
            settings = TreeSettings.parse(plugin_tree)
    except ValueError as e:
        raise _FlagError(f"argument --additional-config: treespec tree: {e}") from None
    if k is not None:
        try:
            settings.check_num_speculative_tokens(k, tree_field="the --additional-config tree")
        except ValueError as e:
            raise _FlagError(f"argument {flag}: {e}") from None


def _token_tree_spec(flag: str, tree_raw: Any, k: int | None) -> str:
    """vLLM's ``speculative_token_tree`` (a list of paths) as a ``paths:`` spec."""
    try:
        paths = ast.literal_eval(tree_raw) if isinstance(tree_raw, str) else tree_raw
        paths = [tuple(p) for p in paths]
    except (ValueError, SyntaxError, TypeError):
        msg = f"argument {flag}: speculative_token_tree is not a list of tuples"
        raise _FlagError(msg) from None
    depth = max((len(p) for p in paths), default=0)
    if k is not None and k != depth:
        raise _FlagError(
            f"argument {flag}: num_speculative_tokens={k} contradicts "
            f"speculative_token_tree of depth {depth}"
        )
    return f"paths:{paths!r}"


def _sglang_flags(a: argparse.Namespace) -> tuple[str | None, tuple[str, Path | None] | None, str]:
    """SGLang's flags -> (tree spec or None, (drafter kind, path) or None, flag named)."""
    algo = a.speculative_algorithm
    if algo is not None and algo.upper() not in SGLANG_ALGORITHMS:
        raise _FlagError(
            f"argument --speculative-algorithm: {algo!r} is not supported; use one of "
            f"{sorted(SGLANG_ALGORITHMS)}"
        )
    kind = SGLANG_ALGORITHMS[algo.upper()] if algo else "eagle"
    drafter = ("ngram", None) if kind == "ngram" else None
    if a.speculative_draft_model_path is not None:
        if kind == "ngram":
            raise _FlagError(
                "argument --speculative-draft-model-path: not allowed with "
                "--speculative-algorithm NGRAM (it has no draft model)"
            )
        drafter = (kind, a.speculative_draft_model_path)
    named = (
        ("--speculative-eagle-topk", a.speculative_eagle_topk),
        ("--speculative-num-steps", a.speculative_num_steps),
        ("--speculative-num-draft-tokens", a.speculative_num_draft_tokens),
    )
    for name, v in named:
        if v is not None and v < 1:
            raise _FlagError(f"argument {name}: must be >= 1, got {v}")
    flags = [n for n, v in named if v is not None]
    if not flags:
        return None, drafter, "--speculative-algorithm"
    topk, steps, ntok = (v for _, v in named)
    topk = 1 if topk is None else topk
    if steps is None:
        if topk == 1 and ntok is not None:
            steps = ntok - 1
        else:
            raise _FlagError(f"argument {flags[0]}: needs --speculative-num-steps (the tree depth)")
    if topk == 1:
        if ntok is not None and ntok != steps + 1:
            raise _FlagError(
                f"argument --speculative-num-draft-tokens: {ntok} contradicts "
                f"--speculative-num-steps {steps} with top-k 1 (a chain needs steps + 1)"
            )
        if steps < 1:
            raise _FlagError("argument --speculative-num-draft-tokens: must be >= 2")
        return f"chain:{steps}", drafter, flags[0]
    budget = (ntok - 1) if ntok is not None else topk * steps
    if budget < 1:
        raise _FlagError("argument --speculative-num-draft-tokens: must be >= 2")
    return f"topk:k={topk},depth={steps},budget={budget}", drafter, flags[0]


def resolve_model_flag(
    parser: argparse.ArgumentParser, model: str | None
) -> tuple[Path, str | None]:
    """``--model`` -> ``(directory, its name or None)``: a name of
    ``tree_dev.models.named`` (fetched on first use) or an existing directory; none
    given: ``DEFAULT_MODEL_SET``. Anything else exits with status 2 naming the known
    names."""
    from tree_dev.models.named import FetchError, is_named, resolve_model

    if model is None:
        return DEFAULT_MODEL_SET, None
    try:
        path = resolve_model(model)
    except (ValueError, FileNotFoundError, FetchError) as e:
        parser.error(f"argument --model: {e}")
    return path, (model if is_named(model) else None)


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


@dataclass
class _Policy:
    """The tree and its draft while ``resolve_config`` fills in defaults: which flag set
    each (for error messages) and where the tree came from (``tree_source``)."""

    tree: str | None = None
    tree_flag: str | None = None
    drafter: tuple[str, Path | None] | None = None  # (kind, path)
    drafter_flag: str | None = None
    source: str | None = None
    draft_sampling: bool = False
    sampling_flag: str = "--draft-sampling"  # which flag turned draft sampling on

    def sample_drafts(self, on: bool, flag: str) -> None:
        """Turn draft sampling on (when ``on``), set by ``flag`` unless already on."""
        if on and not self.draft_sampling:
            self.draft_sampling, self.sampling_flag = True, flag


def resolve_config(argv: list[str] | None = None) -> ServeConfig:
    """Parse flags, map vLLM/SGLang forms onto tree specs, apply the engine's defaults.

    Contradictory flags, a bad tree, a tree the engine cannot run, and a
    ``--max-model-len`` above the target's (or draft's) ``max_position_embeddings``
    exit with status 2 (argparse error) naming the flags or both numbers.
    """
    import sys

    parser = build_parser()
    own, passthrough = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    a = parser.parse_args(own)
    engine = a.engine or default_engine()
    if engine == "vllm" and not vllm_installed():
        parser.error("argument --engine: vllm is not installed here (pip install vllm)")
    if passthrough and engine != "vllm":
        parser.error(f"arguments after --: only --engine vllm takes them, got {passthrough}")
    pol, spec_extra, add_extra = _policy_from_flags(parser, a, engine)
    _check_sizes(parser, a, engine)
    model, model_name = resolve_model_flag(parser, a.model)
    if pol.tree == "none" and pol.drafter is not None:
        parser.error(
            f"argument {pol.drafter_flag}: not allowed with {pol.tree_flag} none (unused draft)"
        )
    model, tokenizer = _apply_defaults(parser, a, engine, model, pol)
    _check_policy(parser, engine, pol)
    name = a.served_model_name or model_name
    if name is None:
        name = model.parent.name if model.name == "target" else model.name
    drafter = pol.drafter
    return ServeConfig(
        model=model,
        tokenizer=tokenizer,
        drafter=drafter[0] if drafter else None,
        drafter_path=drafter[1] if drafter else None,
        tree=pol.tree,
        tree_source=pol.source,
        max_model_len=_max_model_len(parser, a.max_model_len, model, drafter),
        engine=engine,
        host=a.host,
        port=a.port,
        max_batch=a.max_batch,
        kernel_backend=a.kernel_backend,
        served_model_name=name,
        dtype=a.dtype,
        device=a.device,
        torch_threads=a.torch_threads,
        gates_report=a.gates_report or GATES_REPORTS[engine],
        log_level=a.log_level,
        enforce_eager=a.enforce_eager,
        draft_sampling=pol.draft_sampling,
        tensor_parallel_size=a.tensor_parallel_size,
        speculative_extra=spec_extra,
        additional_extra=add_extra,
        vllm_args=passthrough,
    )


def _policy_from_flags(
    parser: argparse.ArgumentParser, a: argparse.Namespace, engine: str
) -> tuple[_Policy, dict[str, Any], dict[str, Any]]:
    """The tree and draft the flags give (project, vLLM and SGLang forms), with vLLM's
    extra keys; two flags that disagree are an error naming both."""
    try:
        trees, drafters, spec_extra, add_extra, sampling_flag = _flag_policies(a)
    except _FlagError as e:
        parser.error(str(e))
    if engine == "local":
        for key, extra in (
            ("--speculative-config", spec_extra),
            ("--additional-config", add_extra),
        ):
            for k in sorted(extra):
                log.warning("%s: ignoring key %r (not used by the local engine)", key, k)
    tree_flag, tree = _one_tree(parser, trees)
    if trie_only(tree):  # the n-gram trie drafts from the text itself: no model
        drafters.setdefault(tree_flag, ("ngram", None))
    if len(drafters) > 1:
        (f1, d1), (f2, d2) = list(drafters.items())[:2]
        if d1 != d2:
            parser.error(
                f"argument {f2}: not allowed with {f1} (draft {d2[0]} {d2[1]} vs {d1[0]} {d1[1]})"
            )
    pol = _Policy(
        tree=tree,
        tree_flag=tree_flag,
        drafter=next(iter(drafters.values()), None),
        drafter_flag=next(iter(drafters), None),
        source=tree_flag,
    )
    pol.sample_drafts(sampling_flag is not None, sampling_flag or "--draft-sampling")
    return pol, spec_extra, add_extra


def _flag_policies(a: argparse.Namespace) -> tuple[dict, dict, dict, dict, str | None]:
    """Every tree (flag -> spec) and draft (flag -> (kind, path)) the flags name, vLLM's
    extra keys of ``--speculative-config`` and ``--additional-config``, and the flag that
    turned draft sampling on (None: off)."""
    trees: dict[str, str] = {}
    drafters: dict[str, tuple[str, Path | None]] = {}
    spec_extra: dict[str, Any] = {}
    add_extra: dict[str, Any] = {}
    sampling_flag = "--draft-sampling" if a.draft_sampling else None
    if a.tree is not None:
        trees["--tree"] = a.tree
    if a.draft_model is not None:
        drafters["--draft-model"] = ("draft", a.draft_model)
    if a.eagle_head is not None:
        drafters["--eagle-head"] = ("eagle", a.eagle_head)
    plugin_tree = None
    if a.additional_config is not None:
        plugin_tree, sampling, add_extra = _additional_config(a.additional_config)
        if sampling and sampling_flag is None:
            sampling_flag = "--additional-config"
        if plugin_tree is not None:
            trees["--additional-config"] = plugin_tree
    if a.speculative_config is not None:
        spec, drafter, spec_extra = _vllm_speculative_config(a.speculative_config, plugin_tree)
        if spec is not None:
            trees["--speculative-config"] = spec
        if drafter is not None:
            drafters["--speculative-config"] = drafter
    sglang = (
        a.speculative_algorithm,
        a.speculative_draft_model_path,
        a.speculative_eagle_topk,
        a.speculative_num_steps,
        a.speculative_num_draft_tokens,
    )
    if any(v is not None for v in sglang):
        spec, drafter, flag = _sglang_flags(a)
        if spec is not None:
            trees[flag] = spec
        if drafter is not None:
            drafters["--speculative-draft-model-path"] = drafter
    return trees, drafters, spec_extra, add_extra, sampling_flag


def _one_tree(
    parser: argparse.ArgumentParser, trees: dict[str, str]
) -> tuple[str | None, str | None]:
    """``(flag, spec)`` of the one tree the flags give (None, None: none); two are an
    error naming both, a bad spec one naming its flag."""
    from tree_dev.spec import parse_tree_spec

    if len(trees) > 1:
        (f1, t1), (f2, t2) = list(trees.items())[:2]
        parser.error(f"argument {f2}: not allowed with {f1} (tree {t2!r} vs {t1!r})")
    for flag, spec in trees.items():
        try:
            parse_tree_spec(spec)
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")
    tree_flag = next(iter(trees), None)
    return tree_flag, (trees.get(tree_flag) if tree_flag else None)


def _check_sizes(parser: argparse.ArgumentParser, a: argparse.Namespace, engine: str) -> None:
    if a.tensor_parallel_size < 1:
        parser.error(f"argument --tensor-parallel-size: must be >= 1, got {a.tensor_parallel_size}")
    if a.tensor_parallel_size > 1 and engine != "vllm":
        parser.error(
            f"argument --tensor-parallel-size: {a.tensor_parallel_size} needs --engine vllm "
            "(the local engine runs on one device)"
        )
    if a.max_batch < 1 or (a.max_model_len is not None and a.max_model_len < 2):
        parser.error("argument --max-batch/--max-model-len: must be >= 1 / >= 2")


def _apply_defaults(
    parser: argparse.ArgumentParser,
    a: argparse.Namespace,
    engine: str,
    model: Path,
    pol: _Policy,
) -> tuple[Path, Path | None]:
    """Fill ``pol``'s missing tree and draft from the code's defaults or ``--tree-from``
    (see docs/serve.md); returns the target's directory and the tokenizer's."""
    tokenizer = a.tokenizer
    measured = _measured_policy(parser, a.tree_from, engine, pol.tree_flag or pol.drafter_flag)
    if a.model is None or (model / "target").is_dir():
        # a model set: target/, eagle/ and/or draft/, tokenizer/ (the default set may not
        # be trained yet: its paths are used as they are, and loading says what is missing)
        if tokenizer is None:
            tokenizer = model / "tokenizer"
        _model_set_defaults(engine, model, pol, measured)
        model = model / "target"
    elif pol.tree is None and pol.drafter is None and (model / "config.json").is_file():
        # a plain checkpoint (a pretrained model): auto over a named model's committed
        # EAGLE head (and the n-gram trie), else over its n-gram tries
        pol.tree, pol.source = DEFAULT_TREE, "default for a model without a draft"
        head = eagle_head_dir(str(a.model))
        if head is not None:
            pol.source = "default with the model's committed EAGLE head"
        if measured is not None:
            head = None
            _, pol.tree, pol.source, sampled = measured
            pol.sample_drafts(sampled, "--tree-from")
            if not runs_without_model(pol.tree):
                parser.error(
                    f"argument --tree-from: the {pol.source} is {pol.tree!r}, which needs a "
                    f"draft; {model} is a plain checkpoint without one (was the report "
                    "measured on another model?)"
                )
        if head is not None:
            pol.drafter = ("eagle", head)
        else:
            pol.drafter = None if pol.tree == "none" else ("ngram", None)
    elif pol.drafter is None and pol.tree is not None and not runs_without_model(pol.tree):
        head = eagle_head_dir(str(a.model))
        if head is not None:  # a named model's committed EAGLE head (distill-eagle)
            pol.drafter = ("eagle", head)
    if pol.tree is None:
        if pol.drafter is None:
            pol.tree, pol.source = "none", "no draft given"
        else:
            pol.tree, pol.source = DEFAULT_TREE, f"default with the {pol.drafter[0]} draft"
    if pol.drafter is None and auto_policy(pol.tree) is not None and runs_without_model(pol.tree):
        pol.drafter = ("ngram", None)  # auto without a draft model: its n-gram tries
    return model, tokenizer


def _model_set_defaults(
    engine: str, model: Path, pol: _Policy, measured: tuple[str | None, str, str, bool] | None
) -> None:
    """A model set's measured policy (``--tree-from``) and its draft: the EAGLE head, else
    the draft model (the local engine prefers the head unless the report names the
    draft), else, for a tree that runs without a model (the default ``auto``), its
    n-gram tries. A tree still unset here is the default (``_apply_defaults``)."""
    if measured is not None and pol.tree is None and pol.drafter is None:
        kind, pol.tree, pol.source, sampled = measured
        if engine == "vllm":
            pol.sample_drafts(sampled, "--tree-from")
            if kind is not None:
                pol.drafter = (kind, None if kind == "ngram" else model / kind)
        elif kind == "ngram":
            pol.drafter = ("ngram", None)
    if pol.drafter is None and pol.tree != "none":
        has_draft, has_eagle = (model / "draft").is_dir(), (model / "eagle").is_dir()
        if not (has_draft or has_eagle) and (pol.tree is None or runs_without_model(pol.tree)):
            pol.drafter = ("ngram", None)
            return
        if engine == "vllm":  # the EAGLE head, exported for vLLM at start-up
            use_draft = has_draft and not has_eagle
        else:
            named_draft = measured is not None and measured[0] == "draft"
            use_draft = has_draft and (not has_eagle or named_draft)
        pol.drafter = ("draft", model / "draft") if use_draft else ("eagle", model / "eagle")


def _check_policy(parser: argparse.ArgumentParser, engine: str, pol: _Policy) -> None:
    """A tree the engine cannot run with its draft (``TreeSettings.parse``: the draft
    sampling rules, ``check_draft``, ``auto``'s candidates against the draft; vLLM runs a
    ``chain:K`` on its own proposers, the local engine drafts n-grams as a trie) is an
    error naming the flag."""
    kind = pol.drafter[0] if pol.drafter is not None else None
    flag = (pol.drafter_flag if kind is not None else pol.tree_flag) or pol.source
    try:
        settings = TreeSettings.parse(
            pol.tree,
            pol.draft_sampling,
            draft=kind,
            builtin_chains=engine == "vllm",
            sampling_field=f"argument {pol.sampling_flag}:",
            draft_field=f"argument {flag}",
        )
    except ValueError as e:
        parser.error(str(e))
    if isinstance(settings.policy, AutoTreePolicy) and not settings.policy.candidates:
        parser.error(
            f"argument {pol.tree_flag or pol.source}: tree {pol.tree!r} has no candidate "
            "besides none (give auto:TREE;TREE;..., or none)"
        )
    if engine == "vllm" and settings.uses_plugin and not vllm_plugin_available():
        parser.error(
            f"argument {pol.source}: tree {pol.tree!r} needs the project's vLLM tree plugin "
            "(tree_dev.vllm_plugin), which is not installed here; vLLM alone runs "
            "chain:K"
        )


def _max_model_len(
    parser: argparse.ArgumentParser,
    max_len: int | None,
    model: Path,
    drafter: tuple[str, Path | None] | None,
) -> int:
    """``--max-model-len``, never above what the target (or draft LM) was trained for (vLLM
    refuses it too); default: the target's ``max_position_embeddings``, else 1024."""
    limits = [("target", model)]
    if drafter is not None and drafter[1] is not None and drafter[0] == "draft":
        limits.append(("draft", drafter[1]))
    for role, path in limits:
        mpe = max_position_embeddings(path)
        if mpe is None:
            continue
        if max_len is None:
            max_len = mpe
        elif max_len > mpe:
            parser.error(
                f"argument --max-model-len: {max_len} is above the {role} model's "
                f"max_position_embeddings {mpe} ({path}/config.json)"
            )
    return 1024 if max_len is None else max_len


# --------------------------------------------------------------------------- vLLM
def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether a tokenizer directory defines a chat template (config key or .jinja file)."""
    d = Path(tokenizer_dir)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def _has_tokenizer(path: Path) -> bool:
    return any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def vllm_settings(cfg: ServeConfig) -> TreeSettings:
    """The config's checked tree choice for vLLM (tree, drafter kind, draft sampling; a
    ``chain:K`` of top-ranked drafts on vLLM's own proposers)."""
    return TreeSettings.parse(cfg.tree, cfg.draft_sampling, draft=cfg.drafter, builtin_chains=True)


def vllm_speculative_config(cfg: ServeConfig) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a config (None for ``tree == "none"``):
    ``TreeSettings.vllm_speculative_config`` with the drafter's path, then the extra keys
    of ``--speculative-config``."""
    sc = vllm_settings(cfg).vllm_speculative_config(cfg.drafter_path)
    return None if sc is None else {**sc, **cfg.speculative_extra}


def vllm_additional_config(cfg: ServeConfig) -> dict[str, Any] | None:
    """vLLM's ``additional_config``: the plugin's ``treespec`` key for a tree (not a chain
    of top-ranked drafts, which vLLM's own proposers run)."""
    ac = dict(cfg.additional_extra)
    settings = vllm_settings(cfg)
    if settings.uses_plugin:
        ac["treespec"] = settings.treespec_section()
    return ac or None


def vllm_engine_kwargs(cfg: ServeConfig) -> dict[str, Any]:
    """vLLM engine arguments of ``cfg``: ``LLM(**kwargs)`` runs what the server runs.

    A chain runs vLLM's own chain proposer (``draft_model``, ``eagle``, ``ngram``);
    any other tree adds ``additional_config={"treespec": {"tree": SPEC}}`` for the
    plugin. The tokenizer is given only when the target directory holds none (vLLM
    reads a tokenizer directory's ``config.json`` too, and the model set's
    ``tokenizer/`` has none).
    """
    kw: dict[str, Any] = {
        "model": str(cfg.model),
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_batch,
        "dtype": cfg.dtype,
    }
    if cfg.tokenizer is not None and not _has_tokenizer(cfg.model):
        kw["tokenizer"] = str(cfg.tokenizer)
    sc = vllm_speculative_config(cfg)
    if sc is not None:
        kw["speculative_config"] = sc
    ac = vllm_additional_config(cfg)
    if ac is not None:
        kw["additional_config"] = ac
    if cfg.enforce_eager:
        kw["enforce_eager"] = True
    if cfg.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = cfg.tensor_parallel_size
    return kw


def vllm_argv(cfg: ServeConfig) -> list[str]:
    """Arguments of ``python -m vllm.entrypoints.openai.api_server`` serving ``cfg``.

    ``vllm_engine_kwargs`` as flags, the server's own flags (host, port, model name,
    the ``/v1/models`` middleware, with ``tree: auto`` the ``/metrics`` one, the plain
    chat template for a tokenizer without one), then ``cfg.vllm_args`` (the words after
    ``--``), last so that they win.
    """
    argv: list[str] = []
    kw = vllm_engine_kwargs(cfg)
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    argv += ["--served-model-name", cfg.served_model_name, "--host", cfg.host]
    argv += ["--port", str(cfg.port), "--uvicorn-log-level", cfg.log_level]
    argv += ["--middleware", VLLM_MODELS_MIDDLEWARE]
    if auto_policy(cfg.tree) is not None:  # auto's choices and step seconds in /metrics
        argv += ["--middleware", VLLM_METRICS_MIDDLEWARE]
    if not has_chat_template(Path(kw.get("tokenizer", cfg.model))):
        argv += ["--chat-template", PLAIN_CHAT_TEMPLATE]
    return argv + list(cfg.vllm_args)
