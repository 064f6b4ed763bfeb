"""What monitoring costs the round: the same engine with and without telemetry.

    python -m bench.telemetry        # writes bench/results/telemetry.json

Two overlap-mode engines on the demo pair, one sending its round and request records to a
real :class:`monitoring.monitor.Monitor` (OpenTelemetry SDK with an in-memory reader, the
drift detectors) every 0.5 s exactly as a replica sends them to the monitor deployment,
one without. Runs alternate (interleaved, ``--reps`` times) at each concurrency; reported:
tokens/s, the engine core's per-round critical-path time (total and overhead) and the
ratios with/without. The round loop's only monitoring work is appending to a list; this
measures whether anything else leaks onto the critical path.
"""

from __future__ import annotations

import argparse
import asyncio

import ray
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from transformers import AutoTokenizer

from bench.common import median, write_result
from bench.pipeline import MODELS, engine_config, run_load
from deployments.frontend.engine_client import EngineClient
from monitoring.monitor import Monitor
from specdec.demo.corpus import read_jsonl
from specdec.sampling import SamplingParams


def make_sink(monitor: Monitor):
    async def sink(batch, requests, cursor):
        monitor.report(batch)
        for r in requests:
            monitor.report_request(r)
        return monitor.alerts_since(cursor)

    return sink


async def bench(args) -> dict:
    tok = AutoTokenizer.from_pretrained(MODELS / "demo-target")
    rows = read_jsonl(MODELS / "prompts" / "python.jsonl")[:8]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    reader = InMemoryMetricReader()
    monitor = Monitor(MeterProvider(metric_readers=[reader]), LoggerProvider())
    cfg = engine_config("overlap", args.k, max(args.concurrency))
    engines = {
        "with": EngineClient(cfg, telemetry=make_sink(monitor), flush_interval_s=0.5),
        "without": EngineClient(cfg),
    }
    for e in engines.values():
        await e.start()
    results: dict = {}
    try:
        for e in engines.values():
            await run_load(e, prompts, 1, 2, params, True)  # warm-up
        for c in args.concurrency:
            n = max(args.min_requests, 2 * c)
            runs = {name: [] for name in engines}
            for _ in range(args.reps):
                for name, e in engines.items():
                    runs[name].append(await run_load(e, prompts, c, n, params, True))
                    print(c, name, runs[name][-1]["tokens_per_s"], flush=True)
            summary = {
                name: {
                    "tokens_per_s": median([r["tokens_per_s"] for r in rs]),
                    "round_ms": median([r["per_round_ms"]["total_ms"] for r in rs]),
                    "overhead_ms": median([r["per_round_ms"]["overhead_ms"] for r in rs]),
                }
                for name, rs in runs.items()
            }
            w, wo = summary["with"], summary["without"]
            results[str(c)] = {
                **summary,
                "tokens_per_s_with_over_without": round(w["tokens_per_s"] / wo["tokens_per_s"], 3),
                "round_ms_with_over_without": round(w["round_ms"] / wo["round_ms"], 3),
            }
    finally:
        for e in engines.values():
            await e.shutdown()
        monitor.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.telemetry", description=__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        results = asyncio.run(bench(args))
    finally:
        ray.shutdown()
    print(write_result("telemetry", vars(args), results).read_text())


if __name__ == "__main__":
    main()
