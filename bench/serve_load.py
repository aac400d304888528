"""Load benchmark of ``serve.py``: N concurrent streaming clients, tree policy vs ``--tree none``.

    python -m bench.serve_load [--quick] [--model DIR] [--clients 1,4,16]
                               [--max-tokens 128] [--torch-threads N] [--random-tiny]

For each policy (the server's default, i.e. the best measured tree policy of
``results/e2e.json``, and ``--tree none``) it starts ``serve.py`` as a subprocess on
a free 127.0.0.1 port, then for each concurrency level runs that many clients,
each sending a bounded number of streaming greedy completions (``ignore_eos`` so
every request produces ``--max-tokens`` tokens) of held-out Python source.

Reported per (policy, concurrency): output throughput (tokens/s over the level's
wall time), time to first token and inter-token latency (p50/p99; ITL is the gap
between token-carrying chunks, i.e. one engine step as the client sees it, and
TPOT the per-token time after the first), and the acceptance length (tokens per
target step, from the ``treespec`` field of each response). Writes
``results/serve_load.json`` and ``results/serve_load.png``.

``--random-tiny`` serves a tiny random model set written to a temporary directory
(for a smoke run without the trained set: its acceptance figures mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.io import atomic_write_bytes, save_figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
LEVEL_TIMEOUT_S = 600  # no level runs longer than this
START_TIMEOUT_S = 300


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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tree_dev.models.data import train_tokenizer
    from tree_dev.models.eagle import EagleHead

    tok = train_tokenizer(make_prompts(8), vocab_size=512)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    target = LlamaForCausalLM(cfg).eval()
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
    """``serve.py`` in a subprocess on 127.0.0.1; its log goes to ``log_path``."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, str(ROOT / "serve.py"), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--log-level", "warning", *args]
        self.cmd = cmd
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self) -> dict:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.py exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve.py did not start in {START_TIMEOUT_S}s; see {self.log_path}")

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


# --------------------------------------------------------------------------- report
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        ("throughput_tok_s", None, "output tokens / s"),
        ("ttft_p50_s", "ttft_p99_s", "time to first token (s)"),
        ("itl_p50_s", "itl_p99_s", "inter-token (chunk) latency (s)"),
        ("acceptance_length", None, "tokens per target step"),
    ]
    for ax, (k50, k99, label) in zip(axes.flat, panels):
        for run in report["runs"]:
            xs = [lv["clients"] for lv in run["levels"]]
            line = ax.plot(xs, [lv[k50] for lv in run["levels"]], "o-", label=run["tree"])[0]
            if k99:
                ax.plot(
                    xs,
                    [lv[k99] for lv in run["levels"]],
                    "x--",
                    color=line.get_color(),
                    label=f"{run['tree']} p99",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label + (" p50 (solid) / p99 (dashed)" if k99 else ""))
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"serve.py load ({report['model']}, max_tokens {report['max_tokens']})")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests, shorter outputs")
    p.add_argument("--model", type=Path, help="model set directory (default: serve.py's)")
    p.add_argument("--random-tiny", action="store_true", help="serve a tiny random model set")
    p.add_argument("--tree", help="tree policy to compare with none (default: serve.py's best)")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--requests", type=int, help="requests per level (default 8, quick 4)")
    p.add_argument("--torch-threads", type=int, help="passed to serve.py")
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--out", type=Path, default=RESULTS / "serve_load.json")
    a = p.parse_args(argv)
    clients = [int(c) for c in a.clients.split(",")]
    max_tokens = a.max_tokens or (48 if a.quick else 128)
    per_level = a.requests or (4 if a.quick else 8)
    prompts = make_prompts(max(32, max(clients) * 2))
    tmp = None
    model = a.model
    if a.random_tiny:
        tmp = tempfile.TemporaryDirectory()
        model = write_random_tiny(Path(tmp.name))
    common = ["--max-batch", str(max(clients)), "--kernel-backend", a.kernel_backend]
    if model is not None:
        common += ["--model", str(model)]
    if a.torch_threads:
        common += ["--torch-threads", str(a.torch_threads)]
    policies = [["--tree", a.tree]] if a.tree else [[]]
    policies.append(["--tree", "none"])
    report = {
        "model": str(model or "serve.py default"),
        "max_tokens": max_tokens,
        "requests_per_level": per_level,
        "quick": a.quick,
        "runs": [],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(policies) * len(clients), desc="serve_load")
    try:
        for pol in policies:
            log_path = a.out.with_suffix(f".{'none' if 'none' in pol else 'tree'}.log")
            srv = ServerProcess(common + pol, log_path)
            try:
                info = srv.wait_ready()
                tree = info["treespec"]["tree"]
                asyncio.run(run_level(srv.base, info["id"], 1, 1, prompts, 8))  # warm-up
                run = {"tree": tree, "server": info["treespec"], "levels": []}
                for c in clients:
                    per_client = max(1, -(-per_level // c))
                    bar.set_postfix(tree=tree, clients=c)
                    lv = asyncio.run(
                        run_level(srv.base, info["id"], c, per_client, prompts, max_tokens)
                    )
                    run["levels"].append(lv)
                    bar.update()
                report["runs"].append(run)
            finally:
                srv.stop()
    finally:
        bar.close()
        if tmp is not None:
            tmp.cleanup()
    if len(report["runs"]) == 2:
        tree_run, none_run = report["runs"]
        report["speedup_vs_none"] = {
            str(t["clients"]): t["throughput_tok_s"] / n["throughput_tok_s"]
            for t, n in zip(tree_run["levels"], none_run["levels"])
        }
    atomic_write_bytes(a.out, json.dumps(report, indent=2).encode())
    plot(report, a.out.with_suffix(".png"))
    print_table(report)
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")
    return report


def print_table(report: dict) -> None:
    def ms(x):
        return "   -  " if x is None else f"{1000 * x:7.1f}"

    print(
        f"{'tree':32s} {'N':>3s} {'tok/s':>8s} {'TTFT50':>7s} {'TTFT99':>7s} "
        f"{'ITL50':>7s} {'ITL99':>7s} {'TPOT50':>7s} {'tau':>5s}   (times in ms)"
    )
    for run in report["runs"]:
        for lv in run["levels"]:
            tau = lv["acceptance_length"]
            print(
                f"{run['tree'][:32]:32s} {lv['clients']:3d} {lv['throughput_tok_s']:8.1f} "
                f"{ms(lv['ttft_p50_s'])} {ms(lv['ttft_p99_s'])} {ms(lv['itl_p50_s'])} "
                f"{ms(lv['itl_p99_s'])} {ms(lv['tpot_p50_s'])} "
                f"{tau if tau is None else round(tau, 2)!s:>5s}"
            )
    for c, s in report.get("speedup_vs_none", {}).items():
        print(f"throughput tree / none at {c} clients: {s:.2f}x")


if __name__ == "__main__":
    main()
