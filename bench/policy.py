"""The length policy against always-on and always-off speculation, over HTTP.

    python -m bench.policy --shipped                     # what a user gets (see below)
    python -m bench.policy                               # demo pair, Python prompts
    python -m bench.policy --draft demo-draft-python --prompts prose --name policy_drift

``--shipped`` (``bench/results/policy_shipped.*``): the shipped
``cluster/serve/demo.yaml`` as it is (only the ports changed), a **fresh** application for
every concurrency, prompts the recipe never saw (:mod:`bench.heldout`: third-party Python
and licence texts), waves of c concurrent 64-token greedy requests alternating between
the default (the config's policy) and speculation off, the order rotated every pair and
both waves of a pair sending the same prompts (``default_over_off_paired``: the median of
the pairs' ratios; ``default_over_off``: the ratio of the modes' median waves). Each
application is used once ``/health`` says ok, as ``make serve`` waits for it (its graphs
compiled; the seconds are recorded as ``startup_s``), after one uncounted wave with
speculation off (``warmup_wave``), which opens the client's connections and runs the
server's first batches: the first wave of a fresh server was slower whatever it did, and
it was always the default's. Every wave after it counts: the ratio is what a user gets
from the first minute, the policy's learning and all (off rows teach it nothing). Per
wave it also records how much the default drafted (the policy's choices settling).

Without ``--shipped``:

Starts a local Ray + Serve with the demo app (``speculation.policy: goodput``, k up to
``--k``), then at each concurrency runs, interleaved in blocks and repeated ``--reps``
times: **on** (each request sets ``num_speculative_tokens: k``: a request's own k always
wins, so this is fixed-k speculation), **off** (``speculation.enabled: false``: target
only) and **policy** (no k: the goodput policy chooses per round). Greedy completions of
held-out prompts. The policy's requests carry their own domain (``metadata.domain``), so
its acceptance estimate is learnt from its own traffic only; round costs are per batch
size for the whole engine, so rounds of the on/off blocks are real cost measurements it
may use (as requests with their own k would be in production). Writes JSON + PNG to
``bench/results/<name>.*`` with machine, commit and settings.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx

from bench.common import median, write_result
from bench.heldout import mixed
from specdec.demo.corpus import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
MODES = ("on", "off", "policy")
SHIPPED = ROOT / "cluster" / "serve" / "demo.yaml"


def app_config(draft: str, k: int, metrics_port: int) -> dict:
    return {
        "engine": {
            "target": {"model": str(MODELS / "demo-target"), "num_threads": 1},
            "draft": {"model": str(MODELS / draft), "num_threads": 1},
            "engine_resources": {"num_cpus": 0.5},
            "target_resources": {"num_cpus": 1},
            "draft_resources": {"num_cpus": 1},
            "speculation": {"num_speculative_tokens": k, "policy": "goodput"},
            "scheduler": {"max_num_seqs": 32, "max_waiting": 1024},
        },
        "num_replicas": 1,
        "monitoring": {"prometheus_port": metrics_port, "prometheus_host": "127.0.0.1"},
    }


async def run_block(http, prompts, mode, concurrency, requests, k, max_tokens, offset):
    """``requests`` completions by ``concurrency`` clients; returns (tokens, seconds)."""
    body = {"model": "demo-target", "max_tokens": max_tokens, "temperature": 0}
    if mode == "on":
        body |= {"speculation": {"enabled": True, "num_speculative_tokens": k}}
        body |= {"metadata": {"domain": "bench-fixed"}}
    elif mode == "off":
        body |= {"speculation": {"enabled": False}, "metadata": {"domain": "bench-fixed"}}
    else:
        body |= {"metadata": {"domain": "bench-policy"}}
    queue = list(range(requests))
    tokens = 0

    async def client():
        nonlocal tokens
        while queue:
            i = queue.pop()
            prompt = prompts[(offset + i) % len(prompts)]
            r = await http.post("/v1/completions", json={**body, "prompt": prompt})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


async def measure(url, prompts, args) -> dict:
    out = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await run_block(http, prompts, "on", 2, 4, args.k, 8, 0)  # warm-up
        for c in args.concurrency:
            requests = max(args.min_requests, 2 * c)
            rates = {m: [] for m in MODES}
            # The policy's first block at this batch size includes its exploration.
            for rep in range(args.reps):
                # Each rep starts with a different mode: a machine that drifts in speed
                # during a block sequence favours no mode.
                for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
                    tok, sec = await run_block(
                        http, prompts, mode, c, requests, args.k, args.max_tokens, rep * 97
                    )
                    rates[mode].append(tok / sec)
                    print(f"c={c} rep={rep} {mode}: {tok / sec:.1f} tok/s", flush=True)
            best = max(median(rates["on"]), median(rates["off"]))
            out[str(c)] = {
                "tokens_per_s": {m: round(median(v), 2) for m, v in rates.items()},
                "all_tokens_per_s": {m: [round(x, 2) for x in v] for m, v in rates.items()},
                "policy_over_best_fixed": round(median(rates["policy"]) / best, 3),
                "policy_over_off": round(median(rates["policy"]) / median(rates["off"]), 3),
                "on_over_off": round(median(rates["on"]) / median(rates["off"]), 3),
            }
    return out


async def shipped_wave(http, prompts, mode, concurrency, requests, max_tokens, start) -> dict:
    """One wave of the shipped-config run: ``requests`` completions, ``concurrency`` at once."""
    body = {"model": "demo-target", "max_tokens": max_tokens, "temperature": 0}
    if mode == "off":
        body |= {"speculation": {"enabled": False}}
    queue = list(range(requests))
    totals = {"tokens": 0, "drafted": 0, "accepted": 0, "spec_rounds": 0}

    async def client():
        while queue:
            i = queue.pop()
            r = await http.post(
                "/v1/completions", json={**body, "prompt": prompts[(start + i) % len(prompts)]}
            )
            r.raise_for_status()
            out = r.json()
            totals["tokens"] += out["usage"]["completion_tokens"]
            spec = out["speculation"]
            totals["drafted"] += spec["drafted"]
            totals["accepted"] += spec["accepted"]
            totals["spec_rounds"] += spec["rounds"]

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    return {"mode": mode, "tokens_per_s": round(totals["tokens"] / seconds, 2), **totals}


def settled_after(waves: list[dict]) -> int:
    """Waves of the default until its drafting (drafted per token) stays within 25 % of the
    last wave's (or under 0.05 drafts per token, for a policy that settles at k = 0)."""
    rates = [w["drafted"] / max(1, w["tokens"]) for w in waves]
    final = rates[-1]

    def close(r: float) -> bool:
        return (r < 0.05 and final < 0.05) or abs(r - final) <= 0.25 * max(final, 0.05)

    first = len(rates)
    for i in range(len(rates) - 1, -1, -1):
        if not close(rates[i]):
            break
        first = i
    return first + 1  # 1-based: the wave from which it stayed


async def measure_shipped(url: str, deploy, args) -> dict:
    """A fresh application per concurrency (``deploy(http)``, which waits until it is
    healthy), then alternating waves."""
    prompts = mixed(args.heldout_prompts, seed=args.seed)
    out = {}
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        for c in args.concurrency:
            startup_s = await deploy(http)
            requests = max(c, args.min_requests)
            # A wave of speculation off first, not counted: a fresh server's first wave ran
            # 9-15 % slower than the next (the client's connections opened, the server's
            # first batches of that size), and it was always the default's, in waves that
            # drafted nothing. Off rows teach the policy nothing: its learning still counts.
            start = (args.waves * requests + c) % len(prompts)  # prompts no pair sends
            warmup = await shipped_wave(http, prompts, "off", c, requests, args.max_tokens, start)
            print(f"c={c} warm-up (off): {warmup['tokens_per_s']:.1f} tok/s", flush=True)
            waves = []
            for pair in range(args.waves):
                order = ("default", "off") if pair % 2 == 0 else ("off", "default")
                # Both waves of a pair send the same prompts (greedy: the same tokens), so
                # a pair's ratio compares the modes on equal work; the next pair sends the
                # next ones (wrapping around the held-out set).
                start = (pair * requests + c) % len(prompts)
                for mode in order:
                    w = await shipped_wave(http, prompts, mode, c, requests, args.max_tokens, start)
                    waves.append(w)
                    print(
                        f"c={c} pair={pair} {mode}: {w['tokens_per_s']:.1f} tok/s, "
                        f"drafted {w['drafted']} for {w['tokens']} tokens",
                        flush=True,
                    )
            rate = {
                m: [w["tokens_per_s"] for w in waves if w["mode"] == m] for m in ("default", "off")
            }
            default = [w for w in waves if w["mode"] == "default"]
            pairs = list(zip(rate["default"], rate["off"], strict=True))
            out[str(c)] = {
                "tokens_per_s_median": {m: round(median(v), 2) for m, v in rate.items()},
                "default_over_off": round(median(rate["default"]) / median(rate["off"]), 3),
                "default_over_off_total": round(sum(rate["default"]) / sum(rate["off"]), 3),
                "default_over_off_first_pair": round(pairs[0][0] / pairs[0][1], 3),
                # Paired: per pair (same prompts, back to back), then the median; a machine
                # whose speed drifts over the run moves both waves of a pair alike.
                "default_over_off_paired": round(median([d / o for d, o in pairs]), 3),
                "pair_ratios": [round(d / o, 3) for d, o in pairs],
                "default_settled_after_waves": settled_after(default),
                "startup_s": startup_s,
                "warmup_wave": warmup,
                "waves": waves,
            }
            r = out[str(c)]
            print(
                f"c={c}: default/off {r['default_over_off']}, "
                f"paired {r['default_over_off_paired']} {r['pair_ratios']}",
                flush=True,
            )
    return out


def plot_shipped(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    ratios = [results[c]["default_over_off"] for c in cs]
    ax.bar(range(len(cs)), ratios, color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.97, color="tab:red", lw=0.8, ls="--", label="0.97")
    ax.set_xticks(range(len(cs)), [f"{c} concurrent" for c in cs])
    ax.set_ylabel("default / speculation off (tokens/s, median of waves)")
    ax.set_title("shipped demo.yaml, fresh server, held-out prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


async def _health(http) -> str | None:
    """``/health``'s status, or None while the proxy has no route yet (it answers in
    plain text then) or refuses the connection."""
    try:
        return (await http.get("/health")).json().get("status")
    except (httpx.HTTPError, ValueError):
        return None


def shipped_main(args) -> None:
    import ray
    import yaml
    from ray import serve

    from deployments.app import build_app
    from tests.conftest import free_port

    (app,) = yaml.safe_load(SHIPPED.read_text())["applications"]
    app_args = app["args"]
    app_args["monitoring"]["prometheus_port"] = free_port()  # the only change: free ports
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    async def deploy(http) -> float:
        """A fresh application (a new core, a new policy), ready as ``make serve`` waits
        for it: /health says ok (models loaded, graphs compiled). Returns the seconds."""
        serve.delete(app["name"])
        started = time.monotonic()
        serve.run(build_app(app_args), name=app["name"], route_prefix=app["route_prefix"])
        while await _health(http) != "ok":
            if time.monotonic() > started + 600:
                raise RuntimeError("the shipped app did not become healthy in 600 s")
            await asyncio.sleep(0.5)
        return round(time.monotonic() - started, 1)

    try:
        results = asyncio.run(measure_shipped(f"http://127.0.0.1:{port}", deploy, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    settings = {
        **vars(args),
        "config": str(SHIPPED.relative_to(ROOT)),
        "prompts": "bench.heldout.mixed",
    }
    path = write_result(args.name, settings, results)
    plot_shipped(results, path.with_suffix(".png"))
    print({c: r["default_over_off"] for c, r in results.items()})


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, mode in enumerate(MODES):
        ax.bar(
            [j + (i - 1) * width for j in range(len(cs))],
            [results[c]["tokens_per_s"][mode] for c in cs],
            width,
            label=mode,
        )
    ax.set_xticks(range(len(cs)), [f"{c} concurrent" for c in cs])
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.policy", description=__doc__)
    parser.add_argument("--draft", default="demo-draft")
    parser.add_argument("--prompts", default="python", choices=["python", "prose"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--name", default=None)
    parser.add_argument("--shipped", action="store_true", help="the shipped config, fresh")
    parser.add_argument("--waves", type=int, default=5, help="--shipped: pairs of waves")
    parser.add_argument("--heldout-prompts", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.shipped:
        if args.concurrency == [1, 4, 16, 32]:
            args.concurrency = [1, 4, 16, 32, 64]
        args.min_requests = max(args.min_requests, 8)
        args.name = args.name or "policy_shipped"
        shipped_main(args)
        return
    args.name = args.name or "policy"

    import ray
    from ray import serve

    from deployments.app import build_specserve_app
    from deployments.config import AppConfig
    from tests.conftest import free_port

    prompts = [r["prompt"] for r in read_jsonl(MODELS / "prompts" / f"{args.prompts}.jsonl")]
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = AppConfig.model_validate(app_config(args.draft, args.k, free_port()))
    serve.run(build_specserve_app(config=cfg, name="Bench"), name="Bench", route_prefix="/")
    try:
        results = asyncio.run(measure(f"http://127.0.0.1:{port}", prompts, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    path = write_result(args.name, vars(args), results)
    plot(results, path.with_suffix(".png"), f"policy vs fixed k={args.k} vs off ({args.prompts})")
    print(path.read_text())


if __name__ == "__main__":
    main()
