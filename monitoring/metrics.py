"""SpecServe's OpenTelemetry instruments, and the records replicas send to fill them.

Replicas do not own exporters (a fixed port per replica process would clash): they batch
the records of :mod:`monitoring.records` and send them off the critical path to
the monitor (:mod:`monitoring.monitor`), which records them here. Names follow vLLM's
spec-decode counters where one exists (``vllm:spec_decode_num_drafts`` ->
``specserve.spec_decode.num_drafts``) plus what vLLM lacks: rejection rounds R, so that
the k-free acceptance estimate ``alpha_hat = A / (A + R)`` is one PromQL division. The
GenAI semantic-convention histograms carry their required attributes. Prometheus names
(dots to underscores, ``_seconds`` for unit ``s``, ``_total`` for counters) and PromQL
for each are in ``monitoring/README.md``.
"""

from __future__ import annotations

from opentelemetry.metrics import Meter

from monitoring.records import AdaptationRecord, RequestRecord, RoundBatch, RoundRecord

__all__ = ["RequestRecord", "RoundBatch", "RoundRecord", "SpecServeMetrics"]

# Bucket bounds (seconds) for latencies from sub-millisecond rounds to minute-long requests.
ROUND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class SpecServeMetrics:
    """The instruments, created on one meter; ``record_*`` turn records into data points."""

    def __init__(self, meter: Meter):
        self._spec_decode_instruments(meter)
        self._speculation_instruments(meter)
        self._engine_instruments(meter)
        self._request_instruments(meter)
        self._adaptation_instruments(meter)

    def _spec_decode_instruments(self, meter: Meter) -> None:
        """Counters of verification rounds, per domain and proposer: the acceptance
        figures (alpha_hat = A / (A + R), acceptance by position) and what the telemetry
        buffer dropped."""
        c = meter.create_counter
        self.num_drafts = c("specserve.spec_decode.num_drafts", description="Rounds with drafts.")
        self.num_draft_tokens = c(
            "specserve.spec_decode.num_draft_tokens", description="Draft tokens verified."
        )
        self.num_accepted_tokens = c(
            "specserve.spec_decode.num_accepted_tokens", description="Draft tokens accepted (A)."
        )
        self.num_rejection_rounds = c(
            "specserve.spec_decode.num_rejection_rounds",
            description="Rounds that ended in a rejection (R); alpha_hat = A / (A + R).",
        )
        self.accepted_per_pos = c(
            "specserve.spec_decode.num_accepted_tokens_per_pos",
            description="Accepted draft tokens by draft position (0-based).",
        )
        self.drafts_per_pos = c(
            "specserve.spec_decode.num_drafts_per_pos",
            description="Rounds whose drafts reached each draft position (0-based): with k "
            "varying per round, the denominator of acceptance by position.",
        )
        self.dropped_rounds = c(
            "specserve.telemetry.dropped_rounds",
            description="Sequence-rounds a replica dropped from its telemetry buffer "
            "because the monitor fell behind (the metrics above undercount by this much).",
        )

    def _speculation_instruments(self, meter: Meter) -> None:
        """What the replicas' policies chose, how the speculation cache did, and the
        drift detector's state per domain."""
        c, g = meter.create_counter, meter.create_gauge
        self.cache_hits = c(
            "specserve.speculation.cache_hits", description="Rounds whose drafts were ready."
        )
        self.cache_misses = c(
            "specserve.speculation.cache_misses", description="Rounds that waited for drafts."
        )
        self.k = g("specserve.speculation.k", description="Draft length chosen per domain.")
        self.enabled = g(
            "specserve.speculation.enabled", description="1 while a domain speculates."
        )
        self.break_even = g(
            "specserve.speculation.break_even_alpha",
            description="Per-token acceptance below which speculation loses time.",
        )
        self.proposer_goodput = g(
            "specserve.speculation.proposer_goodput",
            description="Per domain, batch-size bucket and proposer: the committed tokens "
            "per second a row measured (speculation.proposers with the goodput policy).",
        )
        self.proposer_in_use = g(
            "specserve.speculation.proposer_in_use",
            description="1 for the proposer a domain's rows of a batch-size bucket get.",
        )
        self.drift = g(
            "specserve.acceptance_drift", description="1 while a drift alert fires for a domain."
        )
        self.baseline = g(
            "specserve.acceptance_alpha_baseline",
            description="The drift detector's learned baseline acceptance per domain.",
        )

    def _engine_instruments(self, meter: Meter) -> None:
        """The replicas' batch, KV cache, committed tokens, and the parts of a round's
        critical path."""
        c, g, h = meter.create_counter, meter.create_gauge, meter.create_histogram
        self.generation_tokens = c(
            "specserve.generation.tokens", description="Tokens committed to requests."
        )
        self.running = g("specserve.scheduler.running", description="Sequences in the batch.")
        self.waiting = g("specserve.scheduler.waiting", description="Sequences waiting.")
        self.kv_usage = g(
            "specserve.kv_cache.usage",
            description="Fraction of the target's KV cache slots in use (1: new requests "
            "wait for a slot).",
        )
        self.kv_token_usage = g(
            "specserve.kv_cache.token_usage",
            description="Tokens held in the target's KV cache over its capacity.",
        )
        self.verify = h(
            "specserve.round.verify",
            unit="s",
            description="Target pass + verification per engine round.",
            explicit_bucket_boundaries_advisory=ROUND_BUCKETS,
        )
        self.draft_wait = h(
            "specserve.round.draft_wait",
            unit="s",
            description="Time a round waited for its drafts.",
            explicit_bucket_boundaries_advisory=ROUND_BUCKETS,
        )
        self.rank_up = g(
            "specserve.tensor_parallel.rank_up",
            description="Per rank of a split target: 1 when it answered the replica's "
            "latest health poll (0: dead or hung; its group fails at the next pass).",
        )
        self.rank_calls = g(
            "specserve.tensor_parallel.rank_calls",
            description="Per rank of a split target: runner calls it has run (rank 0, the "
            "core: calls broadcast to the group); a rank behind rank 0 is catching up.",
        )
        self.overhead = h(
            "specserve.round.overhead",
            unit="s",
            description="Critical-path time that is neither verification nor draft wait.",
            explicit_bucket_boundaries_advisory=ROUND_BUCKETS,
        )

    def _request_instruments(self, meter: Meter) -> None:
        """Per-request latency, named by the OpenTelemetry GenAI semantic conventions."""
        h = meter.create_histogram
        self.ttft = h(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate the first token.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self.tpot = h(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token after the first.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self.duration = h(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )

    def _adaptation_instruments(self, meter: Meter) -> None:
        """The draft version served and the adaptation loop's outcomes and costs."""
        c, g = meter.create_counter, meter.create_gauge
        self.draft_version = g(
            "specserve.draft_version",
            description="The adapted draft version a replica serves (0: as deployed).",
        )
        self.adaptation_runs = c(
            "specserve.adaptation.runs",
            description="Adaptation outcomes by outcome: started, deployed, rejected, failed, "
            "rolled_back (a deployed version taken back), kept (one that passed its watch).",
        )
        self.validation_gain = g(
            "specserve.adaptation.validation_gain",
            description="The last run's held-back agreement gain on its domain.",
        )
        self.training_tokens = c(
            "specserve.adaptation.training_tokens",
            description="Output tokens adaptation runs trained on (with repeats).",
        )
        self.training_time = c(
            "specserve.adaptation.training_time",
            unit="s",
            description="Wall seconds adaptation runs took (training and validation).",
        )

    def record_rounds(self, batch: RoundBatch) -> None:
        base = {"model": batch.model, "replica": batch.replica}
        self.draft_version.set(batch.draft_version, base)
        for r in batch.rounds:
            if r.drafted <= 0:
                continue
            attrs = {**base, "domain": r.domain, "proposer": r.proposer}
            self.num_drafts.add(1, attrs)
            self.num_draft_tokens.add(r.drafted, attrs)
            self.num_accepted_tokens.add(r.accepted, attrs)
            if r.accepted < r.drafted:
                self.num_rejection_rounds.add(1, attrs)
            for pos in range(r.drafted):
                at = {**attrs, "position": pos}
                self.drafts_per_pos.add(1, at)
                if pos < r.accepted:
                    self.accepted_per_pos.add(1, at)
            if r.proposer == "draft_model":  # (lookup rounds never wait for drafts)
                (self.cache_hits if r.cache_hit else self.cache_misses).add(1, base)
        for domain, tokens in batch.committed.items():
            self.generation_tokens.add(tokens, {**base, "domain": domain})
        for hist, values in (
            (self.verify, batch.verify_s),
            (self.draft_wait, batch.draft_wait_s),
            (self.overhead, batch.overhead_s),
        ):
            for v in values:
                hist.record(v, base)
        if batch.dropped:
            self.dropped_rounds.add(batch.dropped, base)
        self.running.set(batch.running, base)
        self.waiting.set(batch.waiting, base)
        self.kv_usage.set(batch.kv_cache_usage, base)
        self.kv_token_usage.set(batch.kv_cache_token_usage, base)
        for rank in batch.ranks:
            at = {**base, "rank": rank.rank}
            self.rank_up.set(int(rank.up), at)
            if rank.up:
                self.rank_calls.set(rank.calls, at)

    def record_request(self, rec: RequestRecord) -> None:
        attrs = {
            "gen_ai.operation.name": rec.operation,
            "gen_ai.system": "specserve",
            "gen_ai.request.model": rec.model,
            "model": rec.model,
            "replica": rec.replica,
            "domain": rec.domain,
        }
        if rec.error_type:
            attrs["error.type"] = rec.error_type
        self.duration.record(rec.duration_s, attrs)
        if rec.time_to_first_token_s is not None:
            self.ttft.record(rec.time_to_first_token_s, attrs)
            if rec.output_tokens > 1:
                per_token = (rec.duration_s - rec.time_to_first_token_s) / (rec.output_tokens - 1)
                self.tpot.record(per_token, attrs)

    def set_policy(self, model: str, replica: str, domain: str, k: int, break_even: float) -> None:
        attrs = {"model": model, "replica": replica, "domain": domain}
        self.k.set(k, attrs)
        self.enabled.set(int(k > 0), attrs)
        self.break_even.set(break_even, attrs)

    def set_proposers(self, model: str, replica: str, domain: str, buckets: dict) -> None:
        """The proposer choice of one domain: ``{bucket: {"method", "goodput": {m: r}}}``."""
        for bucket, info in buckets.items():
            base = {"model": model, "replica": replica, "domain": domain, "bucket": bucket}
            for method, rate in (info.get("goodput") or {}).items():
                attrs = {**base, "proposer": method}
                self.proposer_in_use.set(int(method == info.get("method")), attrs)
                if rate is not None:
                    self.proposer_goodput.set(rate, attrs)

    def set_drift(self, model: str, domain: str, firing: bool, baseline: float | None) -> None:
        attrs = {"model": model, "domain": domain}
        self.drift.set(int(firing), attrs)
        if baseline is not None:
            self.baseline.set(baseline, attrs)

    def record_adaptation(self, rec: AdaptationRecord) -> None:
        attrs = {"model": rec.model, "domain": rec.domain}
        self.adaptation_runs.add(1, {**attrs, "outcome": rec.outcome})
        if rec.gain is not None:
            self.validation_gain.set(rec.gain, attrs)
        if rec.training_tokens:
            self.training_tokens.add(rec.training_tokens, attrs)
        if rec.training_s:
            self.training_time.add(rec.training_s, attrs)
