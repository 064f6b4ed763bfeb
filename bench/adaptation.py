"""Does the drift alert heal? The adaptive demo through the server, as a timeline.

    python -m bench.adaptation               # cluster/serve/demo-adaptive.yaml as shipped
    python -m bench.adaptation --control     # the same with adaptation off (set at start)
    python -m bench.adaptation --smoke       # a short run for CI (tests/adaptation/)
    python -m bench.adaptation --serving-cost  # tokens/s while a run trains, interleaved

A fresh application from ``cluster/serve/demo-adaptive.yaml`` (only its ports changed):
the demo target with the Python-only drift draft, adaptation on. Clients send greedy
completions in domain ``python`` (``metadata.domain``, as ``demo.yaml`` reads it): Python
prompts until the domain's drift detector has been in control for ``--in-control-probes``
probes (any alert there is a false alarm: ``false_alarms``), then prose in the same domain
(the shift; the clock starts at the first prose request), then Python again.

Every ``--probe-every-s`` a probe batch measures the draft's acceptance, accepted /
drafted at a fixed k = 4, on Python and on prose prompts from documents the traffic never
contained (:func:`bench.distill.split_prompts`), in domain ``probe`` (not retained: the
config's allow list). The pre-shift level is the last Python probe before the shift, the
drifted level the first prose probe after it; recovery is ``(prose now - drifted) / (pre -
drifted)``. Each row of the timeline also has the draft version every replica serves,
the ``python`` domain's alert state, adaptation's run state, and the traffic's tokens/s
since the row before (so serving while a run trains compares with serving before it).

Every completion, traffic and probes, is checked against transformers ``generate`` of the
target (greedy, computed before the server starts): mismatches and failed requests are
counted, and must be 0. Writes ``bench/results/<name>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from adaptation.config import TrainerConfig
from bench.common import write_result
from bench.distill import split_prompts

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "cluster" / "serve" / "demo-adaptive.yaml"
DOMAIN, PROBE_DOMAIN, PROBE_K = "python", "probe", 4


@dataclass
class Prompts:
    """Token-id prompts: traffic (cycled) and probes (other documents), per kind."""

    traffic: dict[str, list[list[int]]]
    probes: dict[str, list[list[int]]]
    expected: dict[tuple[int, ...], str] = field(default_factory=dict)  # prompt -> greedy text


def load_prompts(args) -> Prompts:
    """The prompts, and the target's greedy text for each (transformers ``generate``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = ROOT / "models" / "demo-target"
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    traffic, probes = {}, {}
    for kind in ("python", "prose"):
        t, p = split_prompts(tok, kind)
        traffic[kind], probes[kind] = t[: args.traffic_prompts], p[: args.probe_prompts]
    prompts = Prompts(traffic, probes)
    todo = [(p, args.max_tokens) for ps in traffic.values() for p in ps]
    todo += [(p, args.probe_tokens) for ps in probes.values() for p in ps]
    with torch.no_grad():
        for ids, n in todo:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
            # (an EOS ends the server's completion and is not in its text)
            prompts.expected[(n, *ids)] = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    return prompts


class Traffic:
    """Clients sending greedy completions in ``DOMAIN``; ``kind`` picks the prompts."""

    def __init__(self, http, prompts: Prompts, args):
        self.http, self.prompts, self.args = http, prompts, args
        self.kind = "python"
        self.tokens = self.requests = self.failed = self.mismatches = 0
        self.examples: list[dict] = []  # the first mismatches, for whoever must explain them
        self.first_at: dict[str, float] = {}  # kind -> when its first request was sent
        self._next = 0

    async def client(self) -> None:
        while True:
            kind = self.kind
            ps = self.prompts.traffic[kind]
            ids, self._next = ps[self._next % len(ps)], self._next + 1
            self.first_at.setdefault(kind, time.monotonic())
            got = await complete(self.http, ids, self.args.max_tokens, DOMAIN, None)
            self.requests += 1
            if got is None:
                self.failed += 1
                continue
            text, usage, _ = got
            self.tokens += usage["completion_tokens"]
            expected = self.prompts.expected[(self.args.max_tokens, *ids)]
            if text != expected:
                self.mismatches += 1
                if len(self.examples) < 10:
                    self.examples.append({"kind": kind, "expected": expected, "got": text})


async def complete(http, ids, max_tokens, domain, k):
    """One greedy completion: (text, usage, speculation report), or None if it failed."""
    body = {"model": "demo-target", "prompt": ids, "max_tokens": max_tokens}
    body |= {"temperature": 0, "metadata": {"domain": domain}}
    if k is not None:
        body["speculation"] = {"num_speculative_tokens": k}
    try:
        r = await http.post("/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    return out["choices"][0]["text"], out["usage"], out.get("speculation") or {}


async def probe(http, prompts: Prompts, args) -> dict:
    """Acceptance (accepted / drafted at k = 4) per kind on the probe prompts."""
    out = {"failed": 0, "mismatches": 0}
    for kind, ps in prompts.probes.items():
        drafted = accepted = 0
        for ids in ps:
            got = await complete(http, ids, args.probe_tokens, PROBE_DOMAIN, PROBE_K)
            if got is None:
                out["failed"] += 1
                continue
            text, _, spec = got
            drafted, accepted = drafted + spec.get("drafted", 0), accepted + spec.get("accepted", 0)
            out["mismatches"] += text != prompts.expected[(args.probe_tokens, *ids)]
        out[kind] = accepted / drafted if drafted else None
    return out


def app_args(args) -> tuple[str, str, dict]:
    """(name, route prefix, args) of the shipped app; only its ports (and, for the
    control run or a smoke run, what those say) changed."""
    from tests.conftest import free_port

    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    cfg = app["args"]
    cfg["monitoring"]["prometheus_port"] = free_port()
    if args.control:
        cfg["adaptation"]["enabled"] = False
    if args.serving_cost:  # the runs measured are the only ones (no drift-started run)
        cfg["adaptation"]["trainer"]["on_drift"] = False
    if args.smoke:  # minutes, not a quarter of an hour: eager models, short warm-up and runs
        for model in ("target", "draft"):
            cfg["engine"][model]["execution_mode"] = "eager"
        cfg["monitoring"]["drift"]["warmup_tokens"] = 300
        # Every round drafts: on a loaded host the goodput policy can find k = 0 paying,
        # and a domain that drafts nothing gives its detector nothing to learn or watch.
        cfg["engine"]["speculation"]["policy"] = "fixed"
        cfg["adaptation"]["trainer"] |= {"min_requests": 4, "steps": 25, "retry_after_s": 20}
        cfg["adaptation"]["rollback"]["window_rounds"] = 8
    return app["name"], app["route_prefix"], cfg


class Server:
    """The application on a local Ray + Serve, with handles to its monitor and
    adaptation deployments."""

    def __init__(self, args):
        import ray
        from ray import serve

        from deployments.app import build_app
        from tests.conftest import free_port

        name, prefix, cfg = app_args(args)
        # a local instance of its own, never a cluster it would find (as make serve's)
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        t0 = time.monotonic()
        serve.run(build_app(cfg), name=name, route_prefix=prefix)
        self.deploy_s = round(time.monotonic() - t0, 1)  # (then /health: graphs compiled)
        self.monitor = serve.get_deployment_handle("SpecServeMonitor", name)
        self.adaptation = serve.get_deployment_handle("SpecServeAdaptation", name)
        self.config = cfg

    async def state(self, http) -> dict:
        """The draft version served, the domain's alert, adaptation's run state."""
        health = (await http.get("/health")).json()
        monitor = await self.monitor.status.remote()
        adaptation = await self.adaptation.status.remote()
        fires = [e for e in monitor["events"] if e["domain"] == DOMAIN and e["kind"] == "fire"]
        return {
            "draft_version": health.get("draft_version"),
            "alert": monitor["domains"].get(DOMAIN, {}).get("state"),
            "fires": len(fires),  # the domain's drift alerts so far (the monitor's history)
            "dispersion": monitor["domains"].get(DOMAIN, {}).get("dispersion"),
            "detector_alpha": monitor["domains"].get(DOMAIN, {}).get("current"),
            "running": adaptation["running"],
            "outcomes": adaptation["outcomes"],
        }

    @staticmethod
    def stop() -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


async def wait_healthy(http, timeout_s: float = 900.0) -> float:
    """Seconds until /health says ok (models loaded, graphs compiled), as make serve."""
    t0 = time.monotonic()
    while True:
        try:
            if (await http.get("/health")).json().get("status") == "ok":
                return round(time.monotonic() - t0, 1)
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError("the app did not become healthy")
        await asyncio.sleep(0.5)


async def timeline(server: Server, prompts: Prompts, args) -> dict:
    """Python traffic until the detector learnt its baseline, prose until recovery (or
    the budget), Python again; a row per probe."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as http:
        startup_s = server.deploy_s + await wait_healthy(http)
        traffic = Traffic(http, prompts, args)
        clients = [asyncio.create_task(traffic.client()) for _ in range(args.concurrency)]
        rows: list[dict] = []
        try:
            await phase(server, http, traffic, prompts, args, rows, "python", learnt)
            traffic.kind = "prose"
            await phase(server, http, traffic, prompts, args, rows, "prose", recovered_or_swapped)
            traffic.kind = "python"
            await phase(server, http, traffic, prompts, args, rows, "python-after", after)
            runs = (await server.adaptation.status.remote())["runs"]
            versions = await server.adaptation.versions.remote()
        finally:
            for c in clients:
                c.cancel()
    shift = traffic.first_at["prose"]
    for row in rows:
        row["t_s"] = round(row.pop("at") - shift, 1)
    totals = {k: getattr(traffic, k) for k in ("requests", "failed", "mismatches", "examples")}
    totals["failed"] += sum(r["probe"]["failed"] for r in rows)
    totals["mismatches"] += sum(r["probe"]["mismatches"] for r in rows)
    summary = summarize(rows, args)
    summary.update(recovered_when(rows, summary))
    return {
        "startup_s": startup_s,
        "rows": rows,
        "totals": totals,
        **summary,
        "runs": runs,
        "versions": versions,
    }


def recovered_when(rows: list[dict], summary: dict) -> dict:
    """Seconds after the shift of the first prose probe 60 % and 90 % of the way back."""
    p, d = summary["pre_alpha"], summary["drifted_alpha"]
    out = {"recovered_60_s": None, "recovered_90_s": None}
    if p is None or d is None or p <= d:
        return out
    for row in rows:
        alpha = row["probe"]["prose"]
        if row["phase"] != "prose" or alpha is None:
            continue
        for share in (60, 90):
            if out[f"recovered_{share}_s"] is None and (alpha - d) / (p - d) >= share / 100:
                out[f"recovered_{share}_s"] = row["t_s"]
    return out


async def phase(server, http, traffic, prompts, args, rows, name, done) -> None:
    """Probe every ``probe_every_s`` until ``done(rows, args)`` or the phase's budget."""
    budget = {"python": args.pre_max_s, "prose": args.budget_s, "python-after": args.after_s}
    t0 = time.monotonic()
    while True:
        tokens0, w0 = traffic.tokens, time.monotonic()
        await asyncio.sleep(args.probe_every_s)
        state = await server.state(http)
        row = {"phase": name, "at": time.monotonic(), **state}
        row["tokens_per_s"] = round((traffic.tokens - tokens0) / (time.monotonic() - w0), 2)
        row["probe"] = await probe(http, prompts, args)
        rows.append(row)
        print({k: row[k] for k in ("phase", "draft_version", "alert", "running", "probe")})
        if done(rows, args) or time.monotonic() - t0 > budget[name]:
            return


async def serving_cost(server: Server, prompts: Prompts, args) -> dict:
    """What a run costs serving: Python traffic's tokens/s in windows with no run, with a
    run as shipped (its ``niceness`` and ``max_serving_slowdown``), with one at priority 0
    unpaced, and with one at priority 0 paced as shipped, interleaved. The runs are
    on-demand with an unreachable ``min_gain`` (never deployed: one draft throughout)
    and train longer than a window."""
    base = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        startup_s = server.deploy_s + await wait_healthy(http)
        traffic = Traffic(http, prompts, args)
        clients = [asyncio.create_task(traffic.client()) for _ in range(args.concurrency)]
        windows: list[dict] = []
        try:
            await asyncio.sleep(args.window_s)  # warm, and requests retained to train on
            labels = list(COST_VARIANTS)
            for rep in range(args.reps):  # the order rotates: no variant always follows one
                for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
                    over = COST_VARIANTS[label]
                    windows.append(await cost_window(server, traffic, args, label, over, rep))
        finally:
            for c in clients:
                c.cancel()
    shipped = TrainerConfig(**server.config["adaptation"]["trainer"])
    out: dict = {
        "startup_s": startup_s,
        "windows": windows,
        "shipped": {
            "niceness": shipped.niceness,
            "max_serving_slowdown": shipped.max_serving_slowdown,
        },
    }
    idle = [w["tokens_per_s"] for w in windows if w["variant"] == "idle"]
    for label in COST_VARIANTS:
        busy = [w["tokens_per_s"] for w in windows if w["variant"] == label]
        if label != "idle":
            out[f"{label}_over_idle"] = (sum(busy) / len(busy)) / (sum(idle) / len(idle))
    out["totals"] = {k: getattr(traffic, k) for k in ("requests", "failed", "mismatches")}
    return out


# A run's trainer overrides per variant (None: no run); the others keep the shipped ones.
COST_VARIANTS: dict[str, dict | None] = {
    "idle": None,
    "shipped": {},
    "priority0_unpaced": {"niceness": 0, "max_serving_slowdown": 1.0},
    "priority0_paced": {"niceness": 0},
}


async def cost_window(server, traffic, args, label, over, rep) -> dict:
    """Traffic tokens/s over one window, with a run with trainer overrides ``over`` going
    (None: no run)."""
    run = None
    if over is not None:
        over = {**over, "min_gain": 10.0, "steps": 100_000, "max_seconds": args.window_s + 10}
        run = asyncio.ensure_future(server.adaptation.adapt.remote("python", over))
        await asyncio.sleep(5)  # the task starts and loads the draft
    tokens0, t0 = traffic.tokens, time.monotonic()
    await asyncio.sleep(args.window_s)
    rate = (traffic.tokens - tokens0) / (time.monotonic() - t0)
    steps = pacing = None
    if run is not None:
        summary = await run
        steps, pacing = summary["train"]["steps"], summary.get("pacing")
    row = {"rep": rep, "variant": label, "tokens_per_s": rate, "train_steps": steps}
    print({**row, "tokens_per_s": round(rate, 1), "pacing": pacing})
    return {**row, "pacing": pacing}


def learnt(rows, args) -> bool:
    """The detector learnt its baseline and stayed quiet on the same traffic for
    ``in_control_probes`` probes (a false alarm would show here, before the shift)."""
    tail = rows[-args.in_control_probes :]
    return len(tail) == args.in_control_probes and all(r["alert"] == "in_control" for r in tail)


def recovered(rows, args) -> bool:
    """``stop_at`` of the way back on the last ``hold_probes`` prose probes (held, not
    touched once)."""
    prose = [r for r in rows if r["phase"] == "prose"]
    if len(prose) < args.hold_probes:
        return False
    pre = summarize(rows, args)
    p, d = pre["pre_alpha"], pre["drifted_alpha"]
    if p is None or d is None or p <= d:
        return False
    tail = [r["probe"]["prose"] for r in prose[-args.hold_probes :]]
    return all(a is not None and (a - d) / (p - d) >= args.stop_at for a in tail)


def recovered_or_swapped(rows, args) -> bool:
    """The smoke run's end of the prose phase: recovered, or a trained draft deployed and
    probed (its swap seen end to end; how far it recovers is the full run's figure). On a
    loaded CI host the phase otherwise ran to its budget after the swap, ~100 s."""
    if recovered(rows, args):
        return True
    prose = [r["draft_version"] for r in rows if r["phase"] == "prose"]
    return bool(args.smoke and prose and prose[-1] != prose[0])


def after(rows, args) -> bool:
    return sum(r["phase"] == "python-after" for r in rows) >= args.after_probes


def summarize(rows: list[dict], args) -> dict:
    """Pre-shift, drifted and latest prose acceptance, the recovery fraction, Python
    before and after (probe figures; None where not measured yet)."""
    pre = [r for r in rows if r["phase"] == "python"]
    shifted = [r for r in rows if r["phase"] == "prose"]
    later = [r for r in rows if r["phase"] == "python-after"]
    out: dict = {"pre_alpha": pre[-1]["probe"]["python"] if pre else None}
    out["pre_prose_alpha"] = pre[-1]["probe"]["prose"] if pre else None
    out["drifted_alpha"] = shifted[0]["probe"]["prose"] if shifted else None
    out["prose_alpha"] = shifted[-1]["probe"]["prose"] if shifted else None
    out["python_after_alpha"] = later[-1]["probe"]["python"] if later else None
    p, d, n = out["pre_alpha"], out["drifted_alpha"], out["prose_alpha"]
    out["recovery"] = (n - d) / (p - d) if None not in (p, d, n) and p > d else None
    # alerts on stationary Python traffic, before the shift: each a false alarm
    out["false_alarms"] = pre[-1]["fires"] if pre else None
    out["dispersion"] = pre[-1]["dispersion"] if pre else None  # phi the detector learnt
    out.update(serving_during_runs(shifted))
    return out


def serving_during_runs(shifted: list[dict]) -> dict:
    """Traffic tokens/s in the probe windows where a run was training, against the
    windows after the shift before the first run (same traffic, same draft)."""
    first = next((i for i, r in enumerate(shifted) if r["running"]), None)
    if first is None or first == 0:
        return {}
    before = [r["tokens_per_s"] for r in shifted[:first]]
    during = [r["tokens_per_s"] for r in shifted if r["running"]]
    b, w = sum(before) / len(before), sum(during) / len(during)
    return {
        "tokens_per_s_before_runs": b,
        "tokens_per_s_during_runs": w,
        "during_over_before": w / b,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.adaptation")
    parser.add_argument("--control", action="store_true", help="adaptation off")
    parser.add_argument("--smoke", action="store_true", help="a short run (CI)")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--probe-tokens", type=int, default=32)
    parser.add_argument("--traffic-prompts", type=int, default=48)
    parser.add_argument("--probe-prompts", type=int, default=4)
    parser.add_argument("--probe-every-s", type=float, default=20.0)
    parser.add_argument("--pre-max-s", type=float, default=600.0)
    parser.add_argument("--budget-s", type=float, default=900.0, help="after the shift")
    parser.add_argument(
        "--in-control-probes",
        type=int,
        default=4,
        help="probes of Python traffic with the detector in control before the shift",
    )
    parser.add_argument("--after-s", type=float, default=180.0)
    parser.add_argument("--after-probes", type=int, default=3)
    parser.add_argument("--stop-at", type=float, default=0.9, help="recovery that ends it")
    parser.add_argument("--hold-probes", type=int, default=3, help="... held this many probes")
    parser.add_argument(
        "--serving-cost", action="store_true", help="tokens/s while runs train, not a timeline"
    )
    parser.add_argument("--window-s", type=float, default=25.0, help="--serving-cost")
    parser.add_argument("--reps", type=int, default=3, help="--serving-cost")
    args = parser.parse_args()
    if args.smoke:
        args.probe_every_s, args.budget_s, args.after_probes = 8.0, 150.0, 1
        args.traffic_prompts, args.probe_prompts, args.max_tokens = 16, 2, 32
        args.probe_tokens, args.stop_at, args.hold_probes = 16, 0.6, 1
        args.in_control_probes = 1
    args.name = args.name or (
        "adaptation"
        + ("_control" if args.control else "")
        + ("_serving_cost" if args.serving_cost else "")
        + ("_smoke" if args.smoke else "")
    )
    prompts = load_prompts(args)
    server = Server(args)
    try:
        measure = serving_cost if args.serving_cost else timeline
        results = asyncio.run(measure(server, prompts, args))
    finally:
        Server.stop()
    settings = {**vars(args), "config": str(CONFIG.relative_to(ROOT)), "app": server.config}
    settings["out"] = None if args.out is None else str(args.out)
    path = write_result(args.name, settings, results, directory=args.out)
    (plot_cost if args.serving_cost else plot)(results, path.with_suffix(".png"), args)
    print({k: v for k, v in results.items() if k != "rows"})


def plot(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    t = [r["t_s"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for kind, style in (("python", "o-"), ("prose", "s-")):
        a.plot(t, [r["probe"][kind] for r in rows], style, label=f"probe alpha, {kind}")
    firing = [x for x, r in zip(t, rows, strict=True) if r["alert"] == "firing"]
    a.scatter(firing, [0.02] * len(firing), marker="|", color="red", label="alert firing")
    for x, r0, r1 in zip(t[1:], rows, rows[1:], strict=False):
        if r1["draft_version"] != r0["draft_version"]:
            a.axvline(x, color="grey", ls=":")
            a.annotate(f"v{r1['draft_version']}", (x, 0.95), fontsize=8)
    a.axvline(0, color="black", lw=0.8)
    a.set_ylabel("accepted / drafted, k = 4")
    a.set_ylim(0, 1)
    a.legend(fontsize=8)
    b.plot(t, [r["tokens_per_s"] for r in rows], "k.-")
    training = [x for x, r in zip(t, rows, strict=True) if r["running"]]
    b.scatter(training, [0] * len(training), marker="|", color="orange", label="run training")
    b.set_ylabel("traffic tokens/s")
    b.set_xlabel("seconds since the first prose request")
    b.legend(fontsize=8)
    title = "control: adaptation off" if args.control else "adaptation on"
    fig.suptitle(f"demo-adaptive.yaml, drift python -> prose ({title})")
    fig.tight_layout()
    fig.savefig(path)


def plot_cost(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {label: f"C{i}" for i, label in enumerate(COST_VARIANTS)}
    for i, w in enumerate(results["windows"]):
        label = w["variant"]
        ax.bar(i, w["tokens_per_s"], color=colors[label], label=label.replace("_", " "))
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_ylabel("traffic tokens/s (python, 2 clients)")
    ax.set_xlabel("window, in the order run")
    ax.set_title("what an adaptation run costs serving (demo-adaptive.yaml)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
