"""Tree policy spec strings, shared by the engine, benchmarks and ``serve.py``.

- ``none``: plain autoregressive decoding (no draft).
- ``chain:K``: a chain of K draft tokens.
- ``paths:[(0,), (1,), (0, 0)]``: a static tree as Medusa / vLLM paths.
- ``medusa:NAME``: a named published tree (``medusa:mc_sim_7b_63``).
- ``topk:k=4,depth=5,budget=32[,temp=T]``: the dynamic top-K proposer (EAGLE-2
  style); ``temp`` sharpens (< 1) the draft's log-probabilities used to *rank*
  nodes, for a draft that is less confident than it is right. It only shapes
  the tree, so verification stays lossless.
- ``ngram:budget=N[,min=1,max=3,matches=8,depth=N,history=H]``: no draft model; the trie of
  the continuations (``depth`` tokens each, default ``budget``) of the ``matches``
  best n-gram matches (``min <= n <= max`` tokens) of the context's suffix in the
  prompt + output, at most ``budget`` draft nodes (``tree_dev.proposer.ngram_trie``).
  Inside vLLM, a spec without ``min``/``max`` takes the ``prompt_lookup_min`` /
  ``prompt_lookup_max`` the user set in the speculative config, so the same fields mean
  the same n-gram range as for vLLM's ``ngram`` (vLLM's own fill-in when neither is
  given, 5 / 5, reads as not given: ``vllm_plugin.config.VLLM_LOOKUP_FILL``).
  ``history=H``: the last ``H`` tokens of the engine's earlier requests (prompt +
  output) are searched too, as SuffixDecoding reuses a server's earlier outputs
  (``tree_dev.proposer.NgramHistory``; default 0: each request on its own).
- ``hybrid:k=2,depth=6,budget=16[,temp=T][,ngram=N,min=,max=,matches=,ndepth=][,p=0.8]``:
  the draft's top-K tree (``k``, ``depth``, ``temp`` as for ``topk``) and the n-gram
  trie (``ngram`` nodes, default ``budget``; ``min``/``max``/``matches`` as for
  ``ngram``; ``ndepth`` its continuation length, default ``ngram``) merged, equal
  paths once, and ranked together by cumulative log-probability: a top-K node by
  the draft's, an n-gram edge by ``log(max(q, p))`` with ``q`` the draft's
  probability of that token where the draft saw the parent; the best ``budget``
  kept (``tree_dev.proposer.HybridExpansion``). ``p=0.8``: the best of 0.5 / 0.8 / 0.95
  by tau with the EAGLE head at budgets 8 and 16 (5.63 and 7.11 tokens per target
  forward, against 4.41 and 5.95 for the top-K tree alone).

Every policy has ``max_nodes`` (root included) and ``draft_budget`` (draft nodes,
``max_nodes - 1``). ``TreeSettings`` is the one typed tree config built from a spec: the
policy, what drafts it (``check_draft``: which draft runs which tree kind), draft sampling,
and its vLLM ``speculative_config`` / plugin section.
"""

from __future__ import annotations

import ast
import os
import types
from dataclasses import dataclass

from tree_dev.tree import PRESETS, TokenTree


@dataclass(frozen=True)
class StaticPolicy:
    """A fixed tree shape; children of a node are the draft's top-ranked tokens."""

    tree: TokenTree
    spec: str

    @property
    def max_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def draft_budget(self) -> int:
        return self.tree.num_nodes - 1


@dataclass(frozen=True)
class TopKPolicy:
    """EAGLE-2 dynamic tree: expand the top-``k`` nodes per level for ``depth``
    levels, keep the best ``budget`` draft nodes by cumulative log-probability."""

    k: int
    depth: int
    budget: int
    spec: str
    temp: float = 1.0

    @property
    def max_nodes(self) -> int:
        return self.budget + 1

    @property
    def draft_budget(self) -> int:
        return self.budget


@dataclass(frozen=True)
class NgramPolicy:
    """Draft-free n-gram trie: continuations of the ``matches`` best matches of the
    context's last ``min_n..max_n`` tokens, ``depth`` tokens each, ``budget`` nodes."""

    budget: int
    spec: str
    min_n: int = 1
    max_n: int = 3
    matches: int = 8
    depth: int = 0  # 0: the budget
    range_given: bool = False  # min= or max= in the spec: vLLM's prompt_lookup_* do not apply
    history: int = 0  # tokens of earlier requests searched too (NgramHistory); 0: none

    def __post_init__(self) -> None:
        if self.depth == 0:
            object.__setattr__(self, "depth", self.budget)

    @property
    def max_nodes(self) -> int:
        return self.budget + 1

    @property
    def draft_budget(self) -> int:
        return self.budget


@dataclass(frozen=True)
class NoDraftPolicy:
    """Plain decoding: the tree is the root alone."""

    spec: str = "none"

    @property
    def max_nodes(self) -> int:
        return 1

    @property
    def draft_budget(self) -> int:
        return 0


@dataclass(frozen=True)
class HybridPolicy:
    """The draft's top-K tree and the n-gram trie, ranked on one scale, ``budget`` kept."""

    topk: TopKPolicy
    ngram: NgramPolicy
    budget: int
    spec: str
    p: float = 0.8  # floor of an n-gram edge's probability

    @property
    def max_nodes(self) -> int:
        return self.budget + 1

    @property
    def draft_budget(self) -> int:
        return self.budget


#: The n-gram trie of continuations of 3-token matches only (``AUTO_MODEL_CANDIDATES``,
#: ``AUTO_TRIE_CANDIDATES``): it exists on fewer steps than a 1-to-3-token trie, and where
#: it does it is right more often (SmolLM2's greedy outputs replayed, ``python -m
#: bench.trie_replay``: 0.57 of its drafts accepted against 0.14 for ``ngram:budget=8``),
#: so it can pay in a batch of 8, where a verify row costs a quarter of a token's share of
#: the step (inside vLLM, run whenever it matches: 0.98-1.10x vLLM plain in every cell of
#: ``bench.auto_policy``, where ``ngram:budget=8`` is 0.63-1.04x). Its acceptance is learnt
#: apart from the wider trie's, on the steps where it matches.
AUTO_LONG_MATCH_TRIE = "ngram:budget=4,min=3"
#: ``tree: auto``'s default candidates with a model draft (a draft LM or an EAGLE head):
#: short and long chains, the sampled-draft chain (sampled requests only), two top-K trees,
#: the hybrid tree and two n-gram tries (``none`` is always a candidate).
AUTO_MODEL_CANDIDATES = (
    "chain:2",
    "chain:4",
    "chain:4+sampled",
    "topk:k=2,depth=4,budget=8",
    "topk:k=4,depth=6,budget=16",
    "hybrid:k=2,depth=6,budget=16",
    "ngram:budget=8",
    AUTO_LONG_MATCH_TRIE,
)
#: ``tree: auto``'s default candidates without a model draft: n-gram tries of three sizes
#: and the long-match trie.
AUTO_TRIE_CANDIDATES = ("ngram:budget=4", "ngram:budget=8", "ngram:budget=16", AUTO_LONG_MATCH_TRIE)


@dataclass(frozen=True)
class AutoTreePolicy:
    """``tree: auto``: per step and request, one of ``candidates`` (or ``none``), chosen by
    ``tree_dev.auto`` from measured step cost and the request's own acceptance.

    ``candidates``: ``(tree, sampled_drafts)`` pairs; ``given``: listed in the spec
    (``auto:chain:2;topk:k=2,depth=4,budget=8;ngram:budget=8``, each checked against the
    engine's draft) rather than the defaults (``AUTO_MODEL_CANDIDATES`` with a model draft,
    ``AUTO_TRIE_CANDIDATES`` without: ``for_draft`` keeps those the draft runs). KV slots and
    vLLM's ``num_speculative_tokens`` are sized for the largest candidate.
    """

    candidates: tuple[tuple[Policy, bool], ...]
    spec: str
    given: bool = False

    @property
    def max_nodes(self) -> int:
        return max((p.max_nodes for p, _ in self.candidates), default=1)

    @property
    def draft_budget(self) -> int:
        return self.max_nodes - 1

    @property
    def names(self) -> list[str]:
        """The candidates as specs (``+sampled`` for sampled drafts)."""
        return [p.spec + ("+sampled" if s else "") for p, s in self.candidates]

    @property
    def needs_model(self) -> bool:
        """Whether some candidate runs a draft model (not only tries and ``none``)."""
        return any(not isinstance(p, _MODEL_FREE) for p, _ in self.candidates)

    @property
    def history(self) -> int:
        """The n-gram history its tries search (the largest ``history=`` of a candidate)."""
        return max((getattr(p, "history", 0) for p, _ in self.candidates), default=0)

    def for_draft(self, draft: str | None) -> AutoTreePolicy:
        """The candidates ``draft`` (one of ``DRAFT_KINDS`` or None) can run: tries and
        ``none`` need no model; every other tree needs ``"draft"`` or ``"eagle"``. Given
        candidates must all run (``ValueError`` naming the first that cannot); the defaults
        are filtered."""
        if draft is not None and draft not in DRAFT_KINDS:
            raise ValueError(
                f"draft {draft!r} for tree {self.spec!r}: expected one of {DRAFT_KINDS} or None"
            )
        model = draft in MODEL_DRAFTS
        if not self.given:
            defaults = AUTO_MODEL_CANDIDATES if model else AUTO_TRIE_CANDIDATES
            return AutoTreePolicy(tuple(map(parse_candidate, defaults)), self.spec)
        keep = []
        for p, sampled in self.candidates:
            if model or isinstance(p, _MODEL_FREE):
                keep.append((p, sampled))
            else:
                what = "none given" if draft is None else f"not {draft!r}"
                raise ValueError(
                    f"tree {self.spec!r}: candidate {p.spec!r} needs a draft (a draft model "
                    f"or an EAGLE head), {what}"
                )
        return AutoTreePolicy(tuple(keep), self.spec, self.given)


def parse_candidate(spec: str) -> tuple[Policy, bool]:
    """``"chain:4"`` -> ``(tree, False)``; ``"chain:4+sampled"`` -> ``(tree, True)``: a
    sampled request's children drawn from the draft (static trees only)."""
    tree, plus, suffix = spec.strip().partition("+")
    if plus and suffix != "sampled":
        raise ValueError(f"candidate {spec!r}: the only suffix is '+sampled'")
    policy = parse_tree_spec(tree)
    if isinstance(policy, AutoTreePolicy):
        raise ValueError(f"candidate {spec!r}: auto cannot be its own candidate")
    if plus and not isinstance(policy, StaticPolicy):
        raise ValueError(f"candidate {spec!r}: sampled drafts need a static tree")
    return policy, bool(plus)


def _parse_auto(spec: str, arg: str) -> AutoTreePolicy:
    parts = [p.strip() for p in arg.split(";")]
    if not arg.strip() or not all(parts):
        raise ValueError(f"empty candidate in {spec!r}; expected auto:TREE;TREE;...")
    seen: dict[str, tuple[Policy, bool]] = {}
    for part in parts:
        try:
            cand = parse_candidate(part)
        except ValueError as e:
            raise ValueError(f"{spec!r}: {e}") from None
        if isinstance(cand[0], NoDraftPolicy):
            continue  # always a candidate
        seen.setdefault(part, cand)
    return AutoTreePolicy(tuple(seen.values()), spec, given=True)


Policy = StaticPolicy | TopKPolicy | NgramPolicy | HybridPolicy | NoDraftPolicy | AutoTreePolicy


def _int_fields(
    spec: str, arg: str, names: tuple[str, ...], floats: tuple[str, ...] = ()
) -> dict[str, float]:
    """``a=1,b=2`` -> ``{"a": 1, "b": 2}``; ValueError naming an unknown, repeated or
    non-integer field, or one < 1 (``floats``: number fields, checked by the caller)."""
    fields: dict[str, float] = {}
    names = names + floats
    for part in arg.split(","):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in names:
            raise ValueError(
                f"bad field {part!r} in {spec!r}; expected " + ", ".join(f"{n}=" for n in names)
            )
        if name in fields:
            raise ValueError(f"field {name!r} given twice in {spec!r}")
        try:
            fields[name] = float(value) if name in floats else int(value)
        except ValueError:
            what = "a number" if name in floats else "an integer"
            raise ValueError(f"field {part!r} in {spec!r} is not {what}") from None
        if name not in floats and fields[name] < 1:
            raise ValueError(f"field {name}= must be >= 1 in {spec!r}")
    return fields


def _parse_ngram(spec: str, arg: str) -> NgramPolicy:
    f = _int_fields(spec, arg, ("budget", "min", "max", "matches", "depth", "history"))
    if "budget" not in f:
        raise ValueError(f"{spec!r} is missing ['budget']")
    lo, hi = f.get("min", 1), f.get("max", max(3, f.get("min", 1)))
    if lo > hi:
        raise ValueError(f"field min= ({lo}) exceeds max= ({hi}) in {spec!r}")
    given = "min" in f or "max" in f
    depth = f.get("depth", f["budget"])
    return NgramPolicy(
        f["budget"], spec, lo, hi, f.get("matches", 8), depth, given, f.get("history", 0)
    )


def _parse_hybrid(spec: str, arg: str) -> HybridPolicy:
    names = ("k", "depth", "budget", "ngram", "min", "max", "matches", "ndepth")
    f = _int_fields(spec, arg, names, floats=("temp", "p"))
    missing = {"k", "depth", "budget"} - set(f)
    if missing:
        raise ValueError(f"{spec!r} is missing {sorted(missing)}")
    temp, p = f.get("temp", 1.0), f.get("p", 0.8)
    if not 0 < temp < float("inf"):
        raise ValueError(f"temp must be > 0 in {spec!r}")
    if not 0 < p <= 1:
        raise ValueError(f"field p= must be in (0, 1] in {spec!r}")
    budget = int(f["budget"])
    topk = TopKPolicy(int(f["k"]), int(f["depth"]), budget, spec, temp)
    ng = ",".join(
        f"{name}={int(f[key])}"
        for name, key in (
            ("min", "min"),
            ("max", "max"),
            ("matches", "matches"),
            ("depth", "ndepth"),
        )
        if key in f
    )
    ngram = _parse_ngram(spec, f"budget={int(f.get('ngram', budget))}" + (f",{ng}" if ng else ""))
    return HybridPolicy(topk, ngram, budget, spec, p)


#: What drafts a tree (``TreeSettings.draft``): ``"ngram"`` the text itself (no model),
#: ``"draft"`` a small causal LM, ``"eagle"`` an EAGLE head. None: no draft.
DRAFT_KINDS = ("ngram", "draft", "eagle")
#: The draft kinds that are models (they run top-K, hybrid and static trees).
MODEL_DRAFTS = ("draft", "eagle")
#: draft kind -> the vLLM speculative method that runs it.
VLLM_METHOD = {"draft": "draft_model", "eagle": "eagle", "ngram": "ngram"}
#: vLLM speculative method -> the draft kind it runs (the methods the tree plugin takes).
DRAFT_OF_VLLM_METHOD = {method: kind for kind, method in VLLM_METHOD.items()}


def draft_slots(policy: Policy) -> int:
    """Draft KV slots a proposal needs past the root: one per draft node the draft forwards
    (a leaf is never forwarded; the n-gram trie forwards none; a hybrid its top-K part).

    >>> [draft_slots(parse_tree_spec(s)) for s in ("topk:k=2,depth=4,budget=8", "chain:4")]
    [6, 3]
    """
    if isinstance(policy, HybridPolicy):  # the draft forwards the top-K part only
        return draft_slots(policy.topk)
    if isinstance(policy, AutoTreePolicy):  # the largest candidate's
        return max((draft_slots(p) for p, _ in policy.candidates), default=0)
    if isinstance(policy, TopKPolicy):
        return policy.k * (policy.depth - 1)
    if isinstance(policy, StaticPolicy):
        tree = policy.tree
        kids = tree.num_children.tolist()
        return sum(1 for n in range(1, tree.num_nodes) if kids[n] > 0)
    return 0


def is_chain(policy: Policy) -> bool:
    """Whether ``policy`` is a ``chain:K``: the one tree vLLM's own proposers run too."""
    return isinstance(policy, StaticPolicy) and policy.spec.startswith("chain:")


def check_draft(policy: Policy, draft: str | None, *, builtin_chains: bool = False) -> None:
    """The one rule of which draft runs which tree kind; a ``ValueError`` names both.

    - ``none``: no draft (``draft`` None);
    - ``ngram:...``: ``"ngram"`` (the trie is drafted from the text itself, no model);
    - ``topk``, ``hybrid``, ``chain``, ``paths``, ``medusa``: ``"draft"`` or ``"eagle"``.

    ``builtin_chains``: vLLM's own proposers run a ``chain:K`` of top-ranked drafts (no
    plugin), and vLLM's ``ngram`` method drafts such a chain too.

    >>> check_draft(parse_tree_spec("ngram:budget=8"), "eagle")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: tree 'ngram:budget=8' is the n-gram trie, ... not 'eagle'
    """
    spec = policy.spec
    if isinstance(policy, AutoTreePolicy):
        policy.for_draft(draft)  # a given candidate the draft cannot run: ValueError
        return
    if draft is not None and draft not in DRAFT_KINDS:
        raise ValueError(
            f"draft {draft!r} for tree {spec!r}: expected one of {DRAFT_KINDS} or None (no draft)"
        )
    if isinstance(policy, NoDraftPolicy):
        if draft is not None:
            raise ValueError(f"tree {spec!r} takes no draft, not {draft!r}")
    elif isinstance(policy, NgramPolicy):
        if draft != "ngram":
            given = "none given" if draft is None else f"not {draft!r}"
            raise ValueError(
                f"tree {spec!r} is the n-gram trie, drafted from the text itself: its draft "
                f"is 'ngram' (no model), {given}"
            )
    elif draft is None:
        raise ValueError(
            f"tree {spec!r} needs a draft (a draft model or an EAGLE head); none given"
        )
    elif draft == "ngram" and not (builtin_chains and is_chain(policy)):
        where = " or, on vLLM's own proposer, chain:K" if builtin_chains else ""
        raise ValueError(
            f"tree {spec!r} needs a draft (a draft model or an EAGLE head), not 'ngram': an "
            f"'ngram' draft runs the trie ngram:budget=N{where}"
        )


@dataclass(frozen=True)
class TreeSettings:
    """The one typed tree config: the tree, what drafts it, and how its drafts are drawn.

    Every surface builds it (``Engine(tree=, draft_sampling=)``, the vLLM plugin's
    ``additional_config["treespec"]``, ``serve.py``'s flags, the benchmarks), so each rule
    lives once: the draft-node budget and KV slots, which draft runs which tree
    (``check_draft``), draft sampling's static tree, and the mapping onto vLLM's
    ``speculative_config`` and the plugin's ``treespec`` section.

    ``draft``: one of ``DRAFT_KINDS`` or None (no draft). ``parse`` without ``draft=`` does
    not check it (the local ``Engine`` checks its own models): an n-gram trie then gets
    ``"ngram"``, any other tree None, and the vLLM mapping refuses a model tree without one.

    >>> s = TreeSettings.parse("topk:k=2,depth=4,budget=8", draft="eagle")
    >>> s.draft_budget, s.draft_slots, s.uses_plugin
    (8, 6, True)
    >>> s.vllm_speculative_config("heads/eagle")
    {'method': 'eagle', 'model': 'heads/eagle', 'num_speculative_tokens': 8}
    >>> s.treespec_section()
    {'tree': 'topk:k=2,depth=4,budget=8'}
    >>> TreeSettings.parse("chain:4", draft_sampling=True).policy.max_nodes
    5
    >>> TreeSettings.parse("ngram:budget=8", draft="draft")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: draft: tree 'ngram:budget=8' is the n-gram trie, ... not 'draft'
    """

    policy: Policy
    draft_sampling: bool = False
    draft: str | None = None

    @property
    def spec(self) -> str:
        return self.policy.spec

    @property
    def draft_budget(self) -> int:
        """Draft nodes of the largest tree (the root not counted): vLLM's
        ``num_speculative_tokens``."""
        return self.policy.draft_budget

    @property
    def draft_slots(self) -> int:
        """Draft KV slots a proposal needs past the root (``draft_slots``)."""
        return draft_slots(self.policy)

    @property
    def uses_plugin(self) -> bool:
        """Whether vLLM needs the tree plugin: every tree but ``none`` and a ``chain:K`` of
        top-ranked drafts (vLLM's own proposers run those)."""
        if isinstance(self.policy, NoDraftPolicy):
            return False
        return self.draft_sampling or not is_chain(self.policy)

    @property
    def vllm_method(self) -> str | None:
        """vLLM's speculative method for the draft (None: no draft, or not said)."""
        return VLLM_METHOD.get(self.draft)

    @classmethod
    def parse(
        cls,
        tree: str | Policy,
        draft_sampling: bool = False,
        *,
        draft: str | None | types.EllipsisType = ...,
        builtin_chains: bool = False,
        sampling_field: str = "draft_sampling",
        draft_field: str = "draft",
    ) -> TreeSettings:
        """Parse (a spec string; a policy is taken as parsed) and check; a ``ValueError``
        names the bad part.

        ``draft``: what drafts the tree (``...``: not said, not checked); ``builtin_chains``:
        see ``check_draft``. ``sampling_field`` / ``draft_field``: how the caller's surface
        spells the draft-sampling switch and the draft, for its messages."""
        policy = parse_tree_spec(tree) if isinstance(tree, str) else tree
        if not isinstance(draft_sampling, bool):
            raise ValueError(f"{sampling_field} = {draft_sampling!r}; expected true or false")
        if draft_sampling and isinstance(policy, AutoTreePolicy):
            raise ValueError(
                f"{sampling_field} with {policy.spec!r}: auto draws a sampled request's drafts "
                "where that pays; list chain:K+sampled among its candidates instead"
            )
        if isinstance(policy, AutoTreePolicy) and draft is not ...:
            try:
                policy = policy.for_draft(draft)
            except ValueError as e:
                raise ValueError(f"{draft_field}: {e}") from None
            return cls(policy, False, draft)
        if draft_sampling and not isinstance(policy, StaticPolicy):
            raise ValueError(
                f"{sampling_field} needs a static tree (chain/paths/medusa), not {policy.spec!r}: "
                "pruning a sampled dynamic tree would bias the accepted tokens"
            )
        if draft_sampling and draft == "ngram":
            raise ValueError(
                f"{sampling_field} needs a draft model or EAGLE head for {policy.spec!r}, not "
                "the 'ngram' draft: an n-gram draft has no distribution"
            )
        if draft is ...:
            draft = "ngram" if isinstance(policy, NgramPolicy) else None
        else:
            try:
                check_draft(policy, draft, builtin_chains=builtin_chains)
            except ValueError as e:
                raise ValueError(f"{draft_field}: {e}") from None
        return cls(policy, draft_sampling, draft)

    def check_num_speculative_tokens(
        self, n: object, *, field: str = "num_speculative_tokens", tree_field: str = "the tree"
    ) -> None:
        """vLLM's ``num_speculative_tokens`` must be the draft-node budget (vLLM sizes its
        draft buffers by it; the plugin fills them with the tree's nodes); a ``ValueError``
        names both (``field`` / ``tree_field``: the caller's names for them)."""
        budget = self.draft_budget
        if n != budget:
            raise ValueError(
                f"{field}={n} must equal the draft-node budget {budget} of {tree_field} "
                f"{self.spec!r} (it has {budget} draft nodes, the root not counted)"
            )

    def vllm_speculative_config(self, model: str | os.PathLike | None = None) -> dict | None:
        """vLLM's ``speculative_config``: the draft's method, ``model`` (the draft model or
        EAGLE head's path) when given, ``num_speculative_tokens`` = the draft-node budget;
        None for ``none``. A draft that cannot run the tree is a ``ValueError``."""
        if isinstance(self.policy, NoDraftPolicy):
            return None
        check_draft(self.policy, self.draft, builtin_chains=not self.uses_plugin)
        if self.draft == "ngram" and model is not None:
            raise ValueError(f"the 'ngram' draft of {self.spec!r} takes no model, got {model!r}")
        sc: dict = {"method": VLLM_METHOD[self.draft]}
        if model is not None:
            sc["model"] = os.fspath(model)
        sc["num_speculative_tokens"] = self.draft_budget
        return sc

    def treespec_section(self) -> dict | None:
        """The plugin's ``additional_config["treespec"]`` keys of this tree: ``tree``, and
        ``draft_sampling`` when on; None for ``none``. (A ``chain:K`` of top-ranked drafts
        runs without it on vLLM's own proposers: ``uses_plugin``.)"""
        if isinstance(self.policy, NoDraftPolicy):
            return None
        section: dict = {"tree": self.spec}
        if self.draft_sampling:
            section["draft_sampling"] = True
        return section


def is_ngram(tree: Policy | str | None) -> bool:
    """Whether ``tree`` (a policy or a spec string) is the n-gram trie, which drafts from
    the text itself, with no model. A string that does not parse is not one (its parse
    names the error where it is used)."""
    if isinstance(tree, str):
        try:
            tree = parse_tree_spec(tree)
        except ValueError:
            return False
    return isinstance(tree, NgramPolicy)


def parse_tree_spec(spec: str) -> Policy:
    """Parse a tree spec string; raises ``ValueError`` naming the bad part."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty tree spec {spec!r}")
    spec = spec.strip()
    if spec == "none":
        return NoDraftPolicy()
    if spec == "auto":
        specs = dict.fromkeys((*AUTO_MODEL_CANDIDATES, *AUTO_TRIE_CANDIDATES))
        return AutoTreePolicy(tuple(map(parse_candidate, specs)), "auto")
    kind, sep, arg = spec.partition(":")
    if not sep:
        raise ValueError(
            f"unknown tree spec {spec!r}; expected none, auto, chain:K, paths:[...], "
            "medusa:NAME, topk:k=..,depth=..,budget=.., ngram:budget=.. or hybrid:.."
        )
    parse = _PARSERS.get(kind)
    if parse is not None:
        return parse(spec, arg)
    raise ValueError(f"unknown tree spec kind {kind!r} in {spec!r}")


def _parse_chain(spec: str, arg: str) -> StaticPolicy:
    try:
        k = int(arg)
    except ValueError:
        raise ValueError(f"chain length in {spec!r} is not an integer") from None
    if k < 1:
        raise ValueError(f"chain length must be >= 1 in {spec!r}")
    return StaticPolicy(TokenTree.chain(k), spec)


def _parse_paths(spec: str, arg: str) -> StaticPolicy:
    try:
        paths = ast.literal_eval(arg)
    except (ValueError, SyntaxError):
        raise ValueError(f"paths in {spec!r} are not a Python literal list of tuples") from None
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ValueError(f"paths in {spec!r} must be a non-empty list of tuples")
    return StaticPolicy(TokenTree.from_paths([tuple(p) for p in paths]), spec)


def _parse_medusa(spec: str, arg: str) -> StaticPolicy:
    if arg not in PRESETS:
        raise ValueError(f"unknown medusa tree {arg!r}; known: {sorted(PRESETS)}")
    return StaticPolicy(TokenTree.preset(arg), spec)


def _parse_topk(spec: str, arg: str) -> TopKPolicy:
    fields = _int_fields(spec, arg, ("k", "depth", "budget"), floats=("temp",))
    temp = fields.pop("temp", 1.0)
    if not 0 < temp < float("inf"):
        raise ValueError(f"temp must be > 0 in {spec!r}")
    missing = {"k", "depth", "budget"} - set(fields)
    if missing:
        raise ValueError(f"{spec!r} is missing {sorted(missing)}")
    return TopKPolicy(int(fields["k"]), int(fields["depth"]), int(fields["budget"]), spec, temp)


_MODEL_FREE = (NgramPolicy, NoDraftPolicy)

_PARSERS = {
    "auto": _parse_auto,
    "chain": _parse_chain,
    "paths": _parse_paths,
    "medusa": _parse_medusa,
    "topk": _parse_topk,
    "ngram": _parse_ngram,
    "hybrid": _parse_hybrid,
}
