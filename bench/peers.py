"""SpecServe against its peer on the same pair: transformers plain and assisted generation.

    python -m bench.peers            # or: make bench-peers
    # writes bench/results/peers.json and peers.png

At batch 1, greedy, on held-out prompts of ``models/prompts/{python,prose}.jsonl`` (taken
from ``--offset`` on, away from the prompts other benchmarks use), and interleaved prompt
by prompt (the order of systems rotates from one prompt to the next), it measures
completion tokens per second of:

* SpecServe over HTTP (the demo app from ``cluster/serve/demo.yaml``, one replica, Serve's
  proxy on loopback), speculation on and off through the per-request switch, and the same
  pair colocated (``cluster/serve/demo-colocated.yaml``: the draft in the target's
  process) on and off;
* transformers ``generate(target)`` and ``generate(target, assistant_model=draft)`` in this
  process, with 1 and 2 torch threads.

The headline is a set of ratios of medians: SpecServe with speculation against assisted
generation, and SpecServe without speculation against plain ``generate``. Greedy outputs
of every system are compared with plain ``generate``'s and the agreement is recorded.
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import httpx
import ray
import torch
import yaml
from ray import serve
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import median, write_result
from deployments.app import build_app
from deployments.config import AppConfig
from specdec.demo.corpus import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
DOMAINS = ("python", "prose")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHAPES = {"": "demo.yaml", "/colocated": "demo-colocated.yaml"}  # route prefix -> config


def start_specserve(max_tokens: int) -> tuple[str, dict[str, float]]:
    """The demo app in both shapes, as ``serve deploy`` would run their configs, one replica
    each: ``cluster/serve/demo.yaml`` at ``/``, ``demo-colocated.yaml`` at ``/colocated``.
    Returns the URL and each shape's seconds from deploy to ``/health`` saying ``ok``
    (models loaded and, compiled, warmed up)."""
    port = free_port()
    startup_s: dict[str, float] = {}
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    for prefix, name in SHAPES.items():
        config = yaml.safe_load((ROOT / "cluster" / "serve" / name).read_text())
        args = config["applications"][0]["args"]
        args.pop("autoscaling_config", None)
        args["num_replicas"] = 1
        args["default_max_tokens"] = max_tokens
        args["monitoring"]["prometheus_port"] = free_port()
        app = f"peers{prefix.replace('/', '-')}"
        started = time.monotonic()
        serve.run(build_app(args), name=app, route_prefix=prefix or "/")
        while httpx.get(f"{url}{prefix}/health").json().get("status") != "ok":
            if time.monotonic() > started + 600:
                raise RuntimeError(f"SpecServe ({name}) did not become healthy")
            time.sleep(0.5)
        startup_s[name] = round(time.monotonic() - started, 1)
    return url, startup_s


class Systems:
    """Every system under test, each a callable prompt -> (token ids or text, tokens)."""

    def __init__(self, url: str, max_tokens: int, dtype: str):
        self.http = httpx.Client(base_url=url, timeout=600)
        self.max_tokens = max_tokens
        self.tok = AutoTokenizer.from_pretrained(MODELS / "demo-target")
        # The dtype SpecServe computes in (transformers would otherwise pick the stored
        # bfloat16): the same arithmetic on both sides, so greedy outputs can agree.
        kw = {"dtype": getattr(torch, dtype)}
        self.target = AutoModelForCausalLM.from_pretrained(MODELS / "demo-target", **kw).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(MODELS / "demo-draft", **kw).eval()

    def specserve(self, prompt: str, speculation: bool, prefix: str = "") -> tuple[str, int]:
        body = {
            "model": "demo-target",
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "speculation": {"enabled": speculation},
        }
        r = self.http.post(f"{prefix}/v1/completions", json=body)
        r.raise_for_status()
        data = r.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]

    def transformers(self, prompt: str, threads: int, assisted: bool) -> tuple[str, int]:
        torch.set_num_threads(threads)
        ids = torch.tensor([self.tok(prompt, add_special_tokens=False)["input_ids"]])
        kwargs = {"assistant_model": self.draft} if assisted else {}
        with torch.inference_mode():
            out = self.target.generate(
                ids, max_new_tokens=self.max_tokens, do_sample=False, **kwargs
            )
        new = out[0, ids.shape[1] :].tolist()
        return self.tok.decode(new, skip_special_tokens=True), len(new)

    def all(self) -> dict:
        return {
            "specserve_on": lambda p: self.specserve(p, True),
            "specserve_off": lambda p: self.specserve(p, False),
            "colocated_on": lambda p: self.specserve(p, True, "/colocated"),
            "colocated_off": lambda p: self.specserve(p, False, "/colocated"),
            "hf_plain_1t": lambda p: self.transformers(p, 1, False),
            "hf_assisted_1t": lambda p: self.transformers(p, 1, True),
            "hf_plain_2t": lambda p: self.transformers(p, 2, False),
            "hf_assisted_2t": lambda p: self.transformers(p, 2, True),
        }


def served_dtype() -> str:
    """The target's compute dtype in ``cluster/serve/demo.yaml`` (the schema's default)."""
    config = yaml.safe_load((ROOT / "cluster" / "serve" / "demo.yaml").read_text())
    args = AppConfig.model_validate(config["applications"][0]["args"])
    return args.engine.target.dtype


def run(args) -> dict:
    systems = Systems(args.url, args.max_tokens, args.dtype)
    runs = systems.all()
    names = list(runs)
    prompts = [
        (domain, row["prompt"])
        for domain in DOMAINS
        for row in read_jsonl(MODELS / "prompts" / f"{domain}.jsonl")[
            args.offset : args.offset + args.prompts
        ]
    ]
    for name in names:  # warm-up: first calls load kernels and fill caches
        runs[name](prompts[0][1])
    rates: dict = {d: {n: [] for n in names} for d in DOMAINS}
    same_as_plain = {n: 0 for n in names}
    for i, (domain, prompt) in enumerate(tqdm(prompts, desc="prompts")):
        order = names[i % len(names) :] + names[: i % len(names)]
        texts = {}
        for name in order:
            t0 = time.perf_counter()
            text, n = runs[name](prompt)
            rates[domain][name].append(n / (time.perf_counter() - t0))
            texts[name] = text
        for name in names:
            same_as_plain[name] += int(texts[name] == texts["hf_plain_1t"])
    table = {d: {n: round(median(v), 2) for n, v in per.items()} for d, per in rates.items()}
    overall = {n: round(median([x for d in DOMAINS for x in rates[d][n]]), 2) for n in names}
    best_assisted = max(overall["hf_assisted_1t"], overall["hf_assisted_2t"])
    best_plain = max(overall["hf_plain_1t"], overall["hf_plain_2t"])
    ratios = {
        "specserve_on_vs_hf_assisted_best": round(overall["specserve_on"] / best_assisted, 3),
        "specserve_off_vs_hf_plain_best": round(overall["specserve_off"] / best_plain, 3),
        "specserve_on_vs_hf_plain_best": round(overall["specserve_on"] / best_plain, 3),
        "colocated_on_vs_hf_assisted_best": round(overall["colocated_on"] / best_assisted, 3),
        "colocated_off_vs_hf_plain_best": round(overall["colocated_off"] / best_plain, 3),
        "colocated_on_vs_specserve_on": round(overall["colocated_on"] / overall["specserve_on"], 3),
        "hf_assisted_vs_hf_plain_1t": round(overall["hf_assisted_1t"] / overall["hf_plain_1t"], 3),
        "per_domain_specserve_on_vs_hf_assisted_1t": {
            d: round(table[d]["specserve_on"] / table[d]["hf_assisted_1t"], 3) for d in DOMAINS
        },
    }
    return {
        "ratios": ratios,
        "tokens_per_s_median": overall,
        "tokens_per_s_median_per_domain": table,
        "greedy_output_equal_to_hf_plain": {n: f"{same_as_plain[n]}/{len(prompts)}" for n in names},
        "samples": {
            d: {n: [round(x, 2) for x in v] for n, v in per.items()} for d, per in rates.items()
        },
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results["tokens_per_s_median_per_domain"]
    names = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - len(names) / 2 + 0.5) * width for j in range(len(table))]
        ax.bar(xs, [table[d][name] for d in table], width, label=name)
    ax.set_xticks(range(len(table)), list(table))
    r = results["ratios"]
    ax.set(
        title=(
            f"batch 1, greedy: SpecServe on / HF assisted = "
            f"{r['specserve_on_vs_hf_assisted_best']}x; "
            f"off / HF plain = {r['specserve_off_vs_hf_plain_best']}x; colocated on / HF "
            f"assisted = {r['colocated_on_vs_hf_assisted_best']}x"
        ),
        ylabel="tokens / s (median)",
    )
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per domain")
    parser.add_argument("--offset", type=int, default=200, help="first prompt used per domain")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--url", default=None, help="a running SpecServe (default: start one)")
    args = parser.parse_args()
    if args.url is None:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        args.url, startup_s = start_specserve(args.max_tokens)
    else:
        startup_s = {}
    args.dtype = served_dtype()
    settings = vars(args) | {
        "serve_config": "cluster/serve/demo.yaml and demo-colocated.yaml (1 replica each)",
        "batch": 1,
        "greedy": True,
        "assisted_generation": "transformers defaults (num_assistant_tokens schedule)",
    }
    results = {**run(args), "startup_s": startup_s}
    path = write_result("peers", settings, results)
    plot(results, path.with_suffix(".png"))
    print(path.read_text())


if __name__ == "__main__":
    main()
