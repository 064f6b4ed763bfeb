"""The n-gram proposer against the draft model, through the server, on text that repeats
its context and on text that does not.

    python -m bench.proposers            # writes bench/results/proposers.json and .png

One fresh demo app (``cluster/serve/demo.yaml`` as ``serve deploy`` runs it, one replica,
with ``speculation.proposers: [draft_model, ngram]`` unless ``--proposers`` says
otherwise) serves greedy completions at concurrency 1 over HTTP. Two workloads from the
held-out prompts of ``models/prompts/{python,prose}.jsonl`` (from ``--offset`` on (280), away
from those other benchmarks use), each its own traffic domain (``metadata.domain``):

* ``repetitive``: a passage, a blank line, then the passage's first half again: a
  continuation that copies what came before (as code edits and answers quoting their
  documents do), where prompt lookup finds long matches;
* ``fresh``: the passages as they are.

Each prompt is sent once per arm, the arms' order rotating from prompt to prompt:
speculation off, ``method: draft_model`` (the draft model under the length policy),
``method: ngram``, and no method (the server's proposer choice, measured per domain).
Reported per workload: each arm's median completion tokens per second and its ratio to
speculation off, the choice's rounds by proposer, and every greedy output compared with
speculation off's (mismatches must be 0).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve
from tqdm import tqdm
from transformers import AutoTokenizer

from bench.common import RESULTS, median, write_result
from bench.peers import free_port
from deployments.app import build_app
from specdec.demo.corpus import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
ARMS = ("off", "draft_model", "ngram", "auto")


def workloads(offset: int, n: int, tokenizer) -> dict[str, list[str]]:
    """``n`` prompts per workload, half Python and half prose, from ``offset`` on."""
    passages = []
    for domain in ("python", "prose"):
        rows = read_jsonl(MODELS / "prompts" / f"{domain}.jsonl")[offset : offset + n // 2]
        passages += [row["prompt"] for row in rows]
    repeated = []
    for text in passages:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        half = tokenizer.decode(ids[: max(4, len(ids) // 2)])
        repeated.append(f"{text}\n\n{half}")
    return {"repetitive": repeated, "fresh": passages}


def start_server(proposers: list[str], max_tokens: int) -> str:
    """The demo app on a free port, one replica, healthy; returns its URL."""
    config = yaml.safe_load((ROOT / "cluster" / "serve" / "demo.yaml").read_text())
    args = config["applications"][0]["args"]
    args.pop("autoscaling_config", None)
    args["num_replicas"] = 1
    args["default_max_tokens"] = max_tokens
    args["monitoring"]["prometheus_port"] = free_port()
    args["engine"]["speculation"]["proposers"] = proposers
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    serve.run(build_app(args), name="proposers", route_prefix="/")
    started = time.monotonic()
    while httpx.get(f"{url}/health").json().get("status") != "ok":
        if time.monotonic() > started + 900:
            raise RuntimeError("the demo app did not become healthy")
        time.sleep(0.5)
    return url


def complete(http: httpx.Client, prompt: str, arm: str, domain: str, max_tokens: int):
    """One greedy completion; (text, completion tokens, seconds, its speculation block)."""
    spec: dict = {"enabled": arm != "off"}
    if arm in ("draft_model", "ngram"):
        spec["method"] = arm
    body = {
        "model": "demo-target",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "speculation": spec,
        "metadata": {"domain": domain},
    }
    t0 = time.perf_counter()
    r = http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    return (
        data["choices"][0]["text"],
        data["usage"]["completion_tokens"],
        seconds,
        data["speculation"],
    )


def run(url: str, loads: dict[str, list[str]], max_tokens: int) -> dict:
    """Every prompt under every arm, interleaved; per workload the arms' figures."""
    out: dict[str, dict] = {}
    with httpx.Client(base_url=url, timeout=600) as http:
        for name, prompts in loads.items():
            rates = {arm: [] for arm in ARMS}
            rounds = {arm: {"draft_model": 0, "ngram": 0} for arm in ARMS}
            mismatches = 0
            for i, prompt in enumerate(tqdm(prompts, desc=name)):
                order = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]
                texts = {}
                for arm in order:
                    text, tokens, seconds, spec = complete(http, prompt, arm, name, max_tokens)
                    texts[arm] = text
                    rates[arm].append(tokens / seconds)
                    for method, n in spec.get("proposer_rounds", {}).items():
                        rounds[arm][method] += n
                mismatches += sum(texts[arm] != texts["off"] for arm in ARMS)
            base = median(rates["off"])
            out[name] = {
                "tokens_per_s": {arm: round(median(r), 2) for arm, r in rates.items()},
                "ratio_to_off": {arm: round(median(r) / base, 3) for arm, r in rates.items()},
                "rounds_by_proposer": rounds,
                "greedy_mismatches": mismatches,
                "requests": len(prompts) * len(ARMS),
            }
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.2
    for j, arm in enumerate(ARMS):
        xs = [i + (j - 1.5) * width for i in range(len(results))]
        ax.bar(xs, [r["ratio_to_off"][arm] for r in results.values()], width, label=arm)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("tokens/s relative to speculation off (median)")
    ax.set_title("Proposers through the server, demo pair, greedy, concurrency 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12, help="per workload")
    parser.add_argument("--offset", type=int, default=280, help="first held-out prompt used")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--proposers", nargs="+", default=["draft_model", "ngram"])
    parser.add_argument("--out", default="proposers", help="result name under bench/results")
    a = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    loads = workloads(a.offset, a.prompts, tokenizer)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # as make serve
    try:
        url = start_server(a.proposers, a.max_tokens)
        results = run(url, loads, a.max_tokens)
    finally:
        serve.shutdown()
        ray.shutdown()
    settings = {
        "config": "cluster/serve/demo.yaml",
        "proposers": a.proposers,
        "prompts_per_workload": a.prompts,
        "offset": a.offset,
        "max_tokens": a.max_tokens,
        "concurrency": 1,
        "arms": list(ARMS),
    }
    path = write_result(a.out, settings, results)
    plot(results, RESULTS / f"{a.out}.png")
    print(path.read_text())


if __name__ == "__main__":
    main()
