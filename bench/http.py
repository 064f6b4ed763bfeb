"""HTTP-level figures against a running SpecServe (e.g. after `make serve`).

    python -m bench.http --url http://127.0.0.1:8000   # writes bench/results/http.json

Measures the round trip of a 1-token completion, and tokens/s of a 128-token greedy
completion with speculation switched on and off per request, alternating on/off so both
see the same machine load.
"""

from __future__ import annotations

import argparse
import time

import httpx

from bench.common import median, write_result
from bench.pair import MODELS
from specdec.demo.corpus import read_jsonl


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="demo-target")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = [r["prompt"] for r in read_jsonl(MODELS / "prompts" / "python.jsonl")[: args.pairs]]
    with httpx.Client(base_url=args.url, timeout=300) as http:
        one = {"model": args.model, "prompt": "x = 1\n", "max_tokens": 1, "temperature": 0}
        http.post("/v1/completions", json=one).raise_for_status()  # warm-up
        rtt = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            http.post("/v1/completions", json=one).raise_for_status()
            rtt.append(time.perf_counter() - t0)
        rates = {"on": [], "off": []}
        reports = []
        for prompt in prompts:
            for mode in ("on", "off"):
                body = {
                    "model": args.model,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "speculation": {"enabled": mode == "on"},
                }
                t0 = time.perf_counter()
                r = http.post("/v1/completions", json=body)
                r.raise_for_status()
                dt = time.perf_counter() - t0
                data = r.json()
                rates[mode].append(data["usage"]["completion_tokens"] / dt)
                if mode == "on":
                    reports.append(data["speculation"])
    results = {
        "one_token_round_trip_ms": {
            "median": round(median(rtt) * 1e3, 2),
            "min": round(min(rtt) * 1e3, 2),
        },
        "tokens_per_s_speculation_on": round(median(rates["on"]), 2),
        "tokens_per_s_speculation_off": round(median(rates["off"]), 2),
        "speedup_on_over_off": round(median(rates["on"]) / median(rates["off"]), 3),
        "acceptance_rate_on": round(
            sum(r["accepted"] for r in reports) / max(1, sum(r["drafted"] for r in reports)), 4
        ),
        "cache_hit_rate_on": round(
            sum(r["cache_hits"] for r in reports) / max(1, sum(r["rounds"] for r in reports)), 4
        ),
    }
    path = write_result("http", vars(args), results)
    print(path.read_text())


if __name__ == "__main__":
    main()
