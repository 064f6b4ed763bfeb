"""The one configuration schema, for Python callers and ``serve deploy`` YAML ``args``.

Every field carries a description so that the schema documents itself (as in Ray Serve
LLM's ``LLMConfig``). Resources always come from here, never from code: the same config
runs the CPU demo and a GPU pair by changing ``num_gpus`` and ``accelerator_type``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from adaptation.config import AdaptationConfig
from monitoring.config import MonitoringConfig

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


PROJECT_ROOT = Path(__file__).resolve().parents[1]


def resolve_model_path(name: str) -> str:
    """Relative paths that do not exist from the working directory are tried against the
    SpecServe checkout, so ``models/demo-target`` works from any Ray worker's cwd; hub ids
    and absolute paths pass through unchanged."""
    path = Path(name)
    if path.is_absolute() or path.exists() or not (PROJECT_ROOT / path).exists():
        return name
    return str(PROJECT_ROOT / path)


class ModelSpec(_Strict):
    """Where a model comes from and how it is loaded."""

    model: str = Field(
        description="Hugging Face hub id or local directory (from_pretrained). Relative "
        "directories are resolved against the working directory, then the SpecServe checkout."
    )
    tokenizer: str | None = Field(
        default=None, description="Tokenizer id or path; defaults to the model's own."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Compute dtype of the weights and KV cache."
    )
    device: str = Field(
        default="auto",
        description="'auto' (cuda when the worker has a GPU, else cpu), or a torch device.",
    )
    trust_remote_code: bool = Field(
        default=False, description="Allow model code from the hub; off unless you trust the repo."
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="Longest prompt + output; unset: the model's limit, at most 8192 (each KV "
        "slot holds this many tokens); an unset draft takes the target's value.",
    )
    max_num_batched_tokens: int = Field(
        default=8192,
        ge=1,
        description="Most tokens one prefill pass of this model carries, padding included "
        "(rows x longest prompt chunk): prompts admitted together run as several passes "
        "past it, so activation memory stays bounded (as vLLM's max_num_batched_tokens).",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch intra-op threads in the worker (CPU); None keeps torch's default.",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        description="KV cache budget of this worker in bytes, allocated once at startup as "
        "slots of max_model_len tokens (at most the slots the worker can use). Unset, and "
        "kv_cache_memory_fraction unset: exactly those slots, refused at startup if the "
        "device's free memory cannot hold them.",
    )
    kv_cache_memory_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="KV cache budget as a fraction of the device's free memory once the "
        "weights are loaded (as vLLM's gpu_memory_utilization, but of what is left); "
        "exclusive with kv_cache_memory_bytes. Fewer slots than max_num_seqs make requests "
        "wait for a free slot, never fail.",
    )
    execution_mode: Literal["eager", "torch_compile", "cuda_graph"] | None = Field(
        default=None,
        description="How the model's forward runs: 'eager' (transformers' modules, one "
        "kernel at a time: the reference), 'torch_compile' (Inductor graphs per pass shape, "
        "compiled at startup while /health says 'warming'; a shape that fails to compile "
        "stays eager) or 'cuda_graph' (on CUDA: the eager kernels recorded as one CUDA graph "
        "per padded pass shape, each at the first pass of its shape, in well under a second; "
        "longer passes such as prefill chunks and shapes that fail to record run eager). "
        "Unset: what bench.costs measured faster on the worker's device type "
        "(cpu: torch_compile; cuda: cuda_graph). Unrelated to speculation.transport.",
    )
    compile_cache_dir: str = Field(
        default="~/.cache/specserve/torch-compile",
        description="Where compiled graphs are kept across restarts (a directory per torch "
        "and transformers version under it), so a restarted worker loads them instead of "
        "compiling again. Their C++ kernels are keyed by the path of the torch installation: "
        "a virtualenv elsewhere compiles them again (docs/models.md).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks the model is split over, one device each (its family's "
        "tensor-parallel plan: attention and MLP layers split by heads and features, two "
        "sums per layer). Rank 0 is the worker itself; the others are TensorParallelRank "
        "actors of the replica's placement group on the same node, each with the worker's "
        "resources. Runs eager. A family without a plan, or head counts the size does not "
        "split, are refused at startup with the reason.",
    )
    default_device: str | None = Field(
        default=None,
        description="torch's default device in the worker's threads once the model is "
        "loaded. A check, not a placement: with 'meta', any tensor the serving path creates "
        "without naming its model's device fails at once (the device-clean test runs so).",
    )

    @model_validator(mode="after")
    def _one_kv_budget(self) -> ModelSpec:
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError("set kv_cache_memory_bytes or kv_cache_memory_fraction, not both")
        if self.execution_mode == "cuda_graph" and not (
            self.device == "auto" or self.device.startswith("cuda")
        ):
            raise ValueError(
                f"execution_mode 'cuda_graph' needs a CUDA device, not device={self.device!r} "
                "(on a CPU it would run padded passes with no graph: use 'torch_compile' or "
                "'eager', or leave execution_mode unset)"
            )
        if self.tensor_parallel_size > 1 and self.execution_mode not in (None, "eager"):
            raise ValueError(
                f"execution_mode {self.execution_mode!r}: a model split over "
                f"tensor_parallel_size = {self.tensor_parallel_size} ranks runs eager (the "
                "sums across ranks are not in the compiled graphs); leave it unset or 'eager'"
            )
        return self

    @field_validator("model", "tokenizer")
    @classmethod
    def _resolve(cls, value: str | None) -> str | None:
        return None if value is None else resolve_model_path(value)


class WorkerResources(_Strict):
    """Ray resources of one worker actor, turned into a placement-group bundle."""

    num_cpus: float = Field(default=1.0, ge=0, description="CPUs reserved for the worker.")
    num_gpus: float = Field(
        default=0.0,
        ge=0,
        description="GPUs reserved for the worker: at most 1 (a fraction shares one). A "
        "worker runs its model on one device; spreading one model over several GPUs "
        "(tensor or pipeline parallel) is not supported, so more would sit idle.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources, e.g. {'target': 1} to pin the worker to labelled nodes.",
    )
    accelerator_type: str | None = Field(
        default=None,
        description="Ray accelerator type, e.g. 'H100'; becomes a resource constraint.",
    )
    cpu_affinity: list[int] | None = Field(
        default=None,
        description="Host cores (ids as the node's OS numbers them) the worker's model "
        "thread runs on: the CPU analogue of owning a GPU, so draft and target do not take "
        "turns on one core. Cores the worker's process may not use are left out (logged); "
        "none usable: unpinned. Unset: the OS places the thread. A colocated draft runs on "
        "the target's.",
    )

    @field_validator("cpu_affinity")
    @classmethod
    def _cores(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 0 or len(set(value)) != len(value)):
            raise ValueError("cpu_affinity: distinct core ids >= 0, at least one")
        return value

    @field_validator("num_gpus")
    @classmethod
    def _one_device(cls, value: float) -> float:
        if value > 1:
            raise ValueError(
                f"num_gpus = {value:g}: a worker runs its model on one GPU (spreading a model "
                "over several, tensor or pipeline parallel, is not supported), so the others "
                "would sit idle; use num_gpus <= 1 (a smaller dtype or a smaller model if it "
                "does not fit)"
            )
        return value


class DraftPlan(NamedTuple):
    """How one request is drafted (:meth:`SpeculationConfig.draft_plan`)."""

    k: int  # drafts per round; with auto_k, the most the length policy may choose [tokens]
    auto_k: bool  # the length policy chooses the draft model's k each round
    method: str  # "draft_model" or "ngram"; with auto_method, the one used until measured
    auto_method: bool  # the proposer choice picks the proposer per domain and batch size


class SpeculationConfig(_Strict):
    """How drafts are produced and how many per round."""

    num_speculative_tokens: int = Field(
        default=4, ge=0, le=16, description="Draft length k per round (the default for requests)."
    )
    max_speculative_tokens: int = Field(
        default=8, ge=0, le=16, description="Upper bound on k for per-request overrides."
    )
    draft_confidence_threshold: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Dynamic draft length: a row stops drafting after the first token the "
        "draft gives less than this probability, so num_speculative_tokens becomes a maximum "
        "(transformers' assisted generation uses 0.4). Exact: the rule sees only the draft. "
        "0 always drafts num_speculative_tokens.",
    )
    mode: Literal["sequential", "overlap"] = Field(
        default="overlap",
        description="'sequential': draft, then verify. 'overlap': the draft prepares the next "
        "round's drafts for the expected verification outcomes while the target verifies.",
    )
    speculation_width: int = Field(
        default=4,
        ge=0,
        le=16,
        description="Overlap mode: verification outcomes prepared per sequence while the target "
        "verifies (all accepted + a bonus token, or a rejection + a recovered token), "
        "likeliest first by the draft's own probabilities and measured acceptance.",
    )
    adaptive_overlap: bool = Field(
        default=True,
        description="Overlap mode: per batch size, narrow speculation when verification "
        "ends before it finished (one sequence: only when nothing was kept), widen it while "
        "it finishes early (batches start at one branch per sequence, one sequence at "
        "speculation_width), keep it only where it measures faster, and pause it "
        "(re-probing) while its hit rate is too low to pay; False always speculates at "
        "speculation_width.",
    )
    policy: Literal["goodput", "fixed"] = Field(
        default="goodput",
        description="'goodput': per traffic domain and batch size, k in 0..num_speculative_"
        "tokens is chosen each round to maximise predicted tokens/s from the domain's "
        "measured acceptance and the measured round cost of each k (0 when no k pays; a "
        "disabled domain is re-probed; drift alerts take effect at once). 'fixed': always "
        "num_speculative_tokens. A request's own num_speculative_tokens always wins, and "
        "seeded requests always use num_speculative_tokens (so that a seed repeats).",
    )
    policy_probe_every: int = Field(
        default=128,
        ge=8,
        description="'goodput' policy: engine rounds between re-probes (4 rounds at k = 1) "
        "of a domain whose speculation is off, so that a recovered domain gets it back.",
    )
    policy_gate: bool = Field(
        default=True,
        description="'goodput' policy: also measure, per batch size, committed tokens per "
        "wall second of the engine's rounds with and without drafting (the work between "
        "rounds included, admitted requests' prefills not) and keep the policy's rows at "
        "k = 0 unless drafting measured 10 % faster (from 2 sequences; 25 % while requests "
        "wait for a slot, a state measured apart that starts without drafting), measuring "
        "the other choice again now and then (specdec/speculation_gate.py); rows admitted "
        "while it is closed are not sent to the draft. False: the per-row prediction alone "
        "decides.",
    )
    disable_by_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="'goodput' policy: rounds of at least this many sequences run the "
        "policy's rows without drafts (no n-gram lookup either for rows whose proposer is "
        "chosen), neither measured nor gated, as vLLM's speculative_disable_by_batch_size "
        "(past scheduler.max_num_seqs it never applies: a config that lowers that keeps "
        "working). For hosts where the draft shares cores with the "
        "HTTP frontend, whose cost no round the gate times can show (the demo on 2 CPU "
        "cores: 8). Requests that set their own num_speculative_tokens or proposer still "
        "draft, as do seeded requests (their k is fixed). None: the policy and its gate "
        "decide at every batch size.",
    )

    proposers: list[Literal["draft_model", "ngram"]] = Field(
        default=["draft_model"],
        min_length=1,
        description="Where drafts may come from for requests that name no proposer: "
        "'draft_model' (the draft model, its k chosen by the length policy) and 'ngram' "
        "(prompt lookup: the tokens that followed the latest earlier occurrence of the "
        "sequence's last n tokens; no model, pays on repetitive text such as code edits "
        "and answers quoting their documents). With both and policy 'goodput', each "
        "traffic domain and batch size gets the one whose rows measured more committed "
        "tokens per second (specdec/proposer_choice.py); else the first listed. A request "
        "may name either (speculation.method), listed or not.",
    )
    ngram_max: int = Field(
        default=4, ge=1, le=16, description="'ngram': the longest suffix looked up [tokens]."
    )
    ngram_min: int = Field(
        default=1,
        ge=1,
        le=16,
        description="'ngram': the shortest suffix looked up; shorter matches propose "
        "nothing (the row decodes plainly that round) [tokens].",
    )

    @model_validator(mode="after")
    def _check_proposers(self):
        if len(set(self.proposers)) != len(self.proposers):
            raise ValueError(f"proposers lists one twice: {self.proposers}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )
        if self.disable_by_batch_size is not None and self.policy != "goodput":
            raise ValueError(
                "disable_by_batch_size needs policy 'goodput' (with 'fixed' every row "
                "drafts num_speculative_tokens)"
            )
        return self

    def draft_plan(
        self,
        enabled: bool,
        requested_k: int | None,
        seeded: bool,
        has_draft: bool,
        method: str | None = None,
    ) -> DraftPlan:
        """The rule for a request's drafting, the one place it lives: its proposer, its
        draft length, and whether policies choose them round by round.

        * Speculation off: k = 0.
        * A named proposer is used, at the request's k or the configured one; a request
          that fixes k without naming one is drafted by the draft model. Only the draft
          model's k is ever the length policy's (n-gram drafts cost no model pass).
        * Else the first of ``proposers`` that can draft (the draft model needs a draft);
          with policy 'goodput' the length policy chooses k (``auto_k``; ``k`` is then its
          upper bound) and, with more than one usable proposer, the proposer choice picks
          per domain and batch size (``auto_method``).
        * A seeded request keeps its proposer and k fixed: which positions carry drafts
          changes the draws, and the policies' choices depend on timing, so its output
          would not repeat.
        """
        off = DraftPlan(0, False, "draft_model", False)
        if not enabled:
            return off
        k = self.num_speculative_tokens if requested_k is None else requested_k
        if method is None and requested_k is not None:
            method = "draft_model"
        if method is not None:
            if method == "draft_model" and not has_draft:
                return off
            auto_k = method == "draft_model" and requested_k is None and self._policy_on(seeded)
            return DraftPlan(k, auto_k, method, False)
        usable = [m for m in self.proposers if m != "draft_model" or has_draft]
        if not usable:
            return off
        auto = self._policy_on(seeded)
        return DraftPlan(k, auto and "draft_model" in usable, usable[0], auto and len(usable) > 1)

    def _policy_on(self, seeded: bool) -> bool:
        return self.policy == "goodput" and not seeded


class SchedulerConfig(_Strict):
    """Continuous batching limits of one engine replica."""

    max_num_seqs: int = Field(
        default=16, ge=1, description="Sequences verified together per round."
    )
    max_waiting: int = Field(
        default=256,
        ge=0,
        description="Requests queued beyond max_num_seqs before rejecting with 503.",
    )


class FaultConfig(_Strict):
    """What to do when a worker dies or hangs."""

    startup_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="How long each worker may take to download and load its model when the "
        "replica starts (draft and target load at the same time; a 16 GB checkpoint from the "
        "hub takes minutes). Progress is logged every 30 s.",
    )
    restart_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long a replacement worker may take to load (its weights are usually "
        "in the node's cache by then).",
    )
    max_target_restarts: int = Field(
        default=2, ge=0, description="Target replacements per engine before requests fail."
    )
    draft_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="How long the engine core waits for a round's drafts before verifying "
        "that round without them (a hung draft never stalls the target).",
    )
    rank_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a tensor-parallel rank waits for the others in a pass before "
        "the group is taken as failed (a rank that died fails it at once). The worker then "
        "exits with its group and is replaced as a failed target is, its requests resumed "
        "from their committed tokens.",
    )
    call_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Most seconds any call to a worker may take (a long-poll: this on top "
        "of its own wait). A worker that does not answer in time is treated as dead and "
        "replaced.",
    )
    iteration_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Most seconds the engine core's loop may stay busy without committing a "
        "model pass (one of max_num_batched_tokens at most; a colocated draft's new weights "
        "count as one). A core stalled for longer (a stuck device call: its process still "
        "answers polls) is replaced, its requests resumed from their committed tokens. Keep "
        "it above the longest pass on your hardware; with a split target, above 3 x "
        "rank_timeout_s, so that a hung rank is reported as one (either way the group is "
        "replaced).",
    )
    liveness_period_s: float = Field(
        default=5.0,
        gt=0,
        description="How often the engine checks that the draft's loop is making progress; "
        "a draft whose loop has not taken a waiting message for call_timeout_s is replaced.",
    )
    restart_backoff_s: float = Field(
        default=1.0,
        gt=0,
        description="Wait before retrying a failed worker replacement; doubles per failure.",
    )
    restart_backoff_max_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest wait between replacement attempts. A draft is retried for as "
        "long as it takes (target-only serves meanwhile); a target max_target_restarts times.",
    )


class EngineConfig(_Strict):
    """Everything one engine replica needs: the pair, resources, placement, pipeline."""

    target: ModelSpec = Field(description="The model whose distribution is served.")
    draft: ModelSpec | None = Field(
        default=None, description="The draft model; None serves the target alone."
    )
    served_model_name: str | None = Field(
        default=None,
        description="Name clients pass as 'model'; defaults to the target path's last part.",
    )
    target_resources: WorkerResources = Field(
        default_factory=WorkerResources, description="Resources of the target worker."
    )
    draft_resources: WorkerResources = Field(
        default_factory=WorkerResources, description="Resources of the draft worker."
    )
    engine_resources: WorkerResources = Field(
        default_factory=lambda: WorkerResources(num_cpus=0.5),
        description="Resources of the engine replica itself (scheduling, HTTP-side work).",
    )
    draft_placement: Literal["actor", "colocated"] = Field(
        default="actor",
        description="'actor': the draft runs in its own actor (its own GPU or node), drafting "
        "ahead while the target verifies (speculation.mode overlap). 'colocated': the draft "
        "runs in the target's process, on the target's device and out of the target's KV "
        "budget, and the two take turns (no actor messages, one CUDA context): the shape "
        "for a pair that shares one device. draft_resources are then unused.",
    )
    placement_strategy: PlacementStrategy = Field(
        default="PACK",
        description="PACK: one node if possible; SPREAD: prefer different nodes; "
        "STRICT_SPREAD: draft and target must be on different nodes.",
    )
    transport: Literal["actor", "compiled_graph"] = Field(
        default="actor",
        description="How a round's outcome reaches the draft and its fresh drafts come back. "
        "'actor': one-way Ray actor calls both ways; prepared branches are pushed during "
        "verification, so a cache hit needs no message at all. 'compiled_graph': one Ray "
        "Compiled Graph execution per round (engine core -> draft -> engine core), tens of "
        "microseconds of transport instead of ~1 ms, but the draft also matches branches, "
        "so every round waits for its reply; its channels poll, so give it spare cores "
        "(a GPU node has them; on a 2-core machine keep 'actor').",
    )
    direct_channel: bool = Field(
        default=True,
        description="Direct TCP connections, each authenticated by a random token passed over "
        "Ray, instead of a Ray actor call per message: the engine core and its draft actor "
        "exchange round messages and pushes (those without sampled rows' q; transport "
        "'actor'), and the replica long-polls the core's outputs (tens of microseconds a hop "
        "instead of ~1.5 ms of a Ray call on a 2-core machine). Ray calls remain the fallback "
        "when one cannot connect or breaks. False: Ray calls only, no ports opened (e.g. "
        "where nodes may not open ports to each other).",
    )
    speculation: SpeculationConfig = Field(
        default_factory=SpeculationConfig, description="Draft length and pipeline mode."
    )
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="Continuous batching limits."
    )
    faults: FaultConfig = Field(default_factory=FaultConfig, description="Worker failure handling.")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.speculation.num_speculative_tokens > self.speculation.max_speculative_tokens:
            raise ValueError("num_speculative_tokens must be <= max_speculative_tokens")
        if self.placement_strategy == "STRICT_SPREAD" and self.draft is None:
            raise ValueError("STRICT_SPREAD places draft and target apart; it needs a draft model")
        if self.draft_placement == "colocated":
            self._check_colocated()
        self._check_tensor_parallel()
        if self.draft is not None and self.draft.max_model_len is None:
            # An unset draft serves as far as the target was asked to: left to its own
            # default (at most 8192), it would stop drafting past it on a longer target.
            self.draft = self.draft.model_copy(update={"max_model_len": self.target.max_model_len})
        return self

    def _check_tensor_parallel(self) -> None:
        """A split model's ranks: a device each, on one node; a split draft in its actor."""
        draft_split = self.draft is not None and self.draft.tensor_parallel_size > 1
        if draft_split and self.draft_placement == "colocated":
            raise ValueError(
                "draft.tensor_parallel_size > 1 with draft_placement 'colocated': a "
                "colocated draft runs in the target's rank 0; split the draft in its own "
                "actor (draft_placement 'actor')"
            )
        for role in ("target", "draft"):
            spec, resources = getattr(self, role), getattr(self, f"{role}_resources")
            if spec is None or spec.tensor_parallel_size == 1:
                continue
            gpus = resources.num_gpus
            if 0 < gpus < 1:
                raise ValueError(
                    f"{role}_resources.num_gpus = {gpus:g} with tensor_parallel_size > 1: "
                    "each rank needs a GPU of its own (NCCL cannot join two ranks on one "
                    "device)"
                )
            if "SPREAD" in self.placement_strategy:
                raise ValueError(
                    f"{role}.tensor_parallel_size > 1 keeps the {role}'s ranks on one node, "
                    f"which {self.placement_strategy} (bundles on different nodes) does not; "
                    "use PACK, or STRICT_PACK for every worker on one node"
                )

    def _check_colocated(self) -> None:
        if self.draft is None:
            raise ValueError("draft_placement 'colocated' needs a draft model")
        if self.placement_strategy == "STRICT_SPREAD":
            raise ValueError(
                "draft_placement 'colocated' puts the draft with the target; "
                "STRICT_SPREAD asks for them apart"
            )
        if self.transport != "actor":
            raise ValueError("transport: a colocated draft sends no messages; leave 'actor'")
        for budget in ("kv_cache_memory_bytes", "kv_cache_memory_fraction"):
            if getattr(self.draft, budget) is not None:
                raise ValueError(
                    f"draft.{budget}: a colocated draft's KV comes out of the target's budget "
                    f"(one budget for both); set target.{budget}"
                )
        if self.draft.device != self.target.device and self.draft.device != "auto":
            raise ValueError(
                f"draft.device {self.draft.device!r}: a colocated draft runs on the target's "
                f"device ({self.target.device!r}); leave it 'auto' or use draft_placement 'actor'"
            )
        if "mode" not in self.speculation.model_fields_set:
            self.speculation.mode = "sequential"  # draft and target take turns
        elif self.speculation.mode == "overlap":
            raise ValueError(
                "speculation.mode 'overlap' drafts while the target verifies, which needs the "
                "draft in its own actor; with draft_placement 'colocated' use 'sequential'"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target.model.rstrip("/").split("/")[-1]


# RFC 6750's b64token, the syntax of a bearer token: keys that fit it travel in any HTTP
# client's Authorization header unchanged, and never contain the ':', ',', '#' or
# whitespace that the name:key[:limit] list format (SPECSERVE_API_KEYS, api_keys_file) uses.
KEY_PATTERN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
DEFAULT_KEY_NAME = "default"  # the name of api_key (SPECSERVE_API_KEY) in logs


def check_key(key: SecretStr) -> SecretStr:
    """Refuse a key that is empty or not a bearer token; the message never quotes it."""
    value = key.get_secret_value()
    if not KEY_PATTERN.fullmatch(value):
        raise ValueError(
            "an API key must be a non-empty bearer token (RFC 6750 b64token: letters, "
            "digits and - . _ ~ + /, then optional '='); e.g. python -c "
            "'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return key


class ApiKey(_Strict):
    """One client's key: the name is what logs show, the key is never shown."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Who the key belongs to, as logs name it (1-64 letters, digits, _ . -).",
    )
    key: SecretStr = Field(
        description="The bearer key (RFC 6750 b64token syntax). Stored as SecretStr: repr, "
        "str and model_dump(mode='json') show '**********'."
    )
    max_concurrent_requests: int | None = Field(
        default=None,
        ge=1,
        description="Most /v1/* requests of this key in flight at once on one replica (a "
        "stream counts until it ends); more get HTTP 429 with Retry-After. None: the "
        "app's max_concurrent_requests_per_key.",
    )

    @field_validator("key")
    @classmethod
    def _bearer_token(cls, value: SecretStr) -> SecretStr:
        return check_key(value)


def check_unique_keys(keys: list[ApiKey]) -> None:
    """Two entries with one name, or one key under two names, are a mistake: refuse them
    (naming the entries, never the key)."""
    names: set[str] = set()
    owners: dict[str, str] = {}  # key -> name
    for k in keys:
        if k.name in names:
            raise ValueError(f"API key name {k.name!r} is used twice")
        names.add(k.name)
        other = owners.setdefault(k.key.get_secret_value(), k.name)
        if other != k.name:
            raise ValueError(f"API keys {other!r} and {k.name!r} are the same key")


class AppConfig(_Strict):
    """The ``args`` of ``deployments.app:build_app`` in a ``serve deploy`` config.

    Validation errors never quote the input (``hide_input_in_errors``): a config holds
    API keys, and an error message ends up in logs."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    engine: EngineConfig = Field(description="The engine each replica runs.")
    api_key: SecretStr | None = Field(
        default=None,
        description="A bearer key for /v1/*, named 'default' in logs. None reads "
        "SPECSERVE_API_KEY from the replica's environment. Keys from api_key, api_keys and "
        "api_keys_file all open the API; with none of them, there is no authentication.",
    )
    api_keys: list[ApiKey] | None = Field(
        default=None,
        description="Named keys, each with an optional concurrency limit. None reads "
        "SPECSERVE_API_KEYS from the replica's environment: entries name:key[:limit] "
        "separated by commas or whitespace. Keys written here are visible to whoever can "
        "read the Serve config (the dashboard shows it): prefer the file or the environment.",
    )
    api_keys_file: str | None = Field(
        default=None,
        description="A file on every node read when a replica starts: one name:key[:limit] "
        "entry per line, '#' starts a comment. None reads the path from "
        "SPECSERVE_API_KEYS_FILE in the replica's environment.",
    )
    max_concurrent_requests_per_key: int | None = Field(
        default=None,
        ge=1,
        description="The concurrency limit of keys that set none, per replica (the proxy "
        "spreads a key's requests over replicas). None: unlimited.",
    )
    rate_limit_retry_after_s: int = Field(
        default=1,
        ge=1,
        le=3600,
        description="Retry-After of a 429 sent to a key at its concurrency limit (a place "
        "frees as soon as one of its requests ends, which the server cannot foresee).",
    )
    max_body_bytes: int = Field(
        default=1_000_000, ge=1024, description="Larger request bodies get HTTP 413."
    )
    default_max_tokens: int = Field(
        default=256,
        ge=1,
        description="max_tokens when a request does not say (capped by the context).",
    )
    monitoring: MonitoringConfig = Field(
        default_factory=MonitoringConfig,
        description="Metrics, drift detection and alerts (the monitor deployment).",
    )
    adaptation: AdaptationConfig = Field(
        default_factory=AdaptationConfig,
        description="Adapting the draft to live traffic: which finished requests are kept "
        "as its training data (the adaptation deployment; off by default).",
    )
    num_replicas: int | None = Field(
        default=1, ge=1, description="Fixed replica count (each owns a draft/target pair)."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        default=None,
        description="Serve autoscaling_config (min_replicas, max_replicas, "
        "target_ongoing_requests, ...); overrides num_replicas.",
    )

    @field_validator("api_key")
    @classmethod
    def _bearer_token(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else check_key(value)

    @model_validator(mode="after")
    def _unique_keys(self) -> AppConfig:
        """The keys written here; those of the environment and of api_keys_file are
        checked with them when a replica starts (deployments/openai/api_keys.py)."""
        single = (
            [ApiKey(name=DEFAULT_KEY_NAME, key=self.api_key)] if self.api_key is not None else []
        )
        check_unique_keys(single + list(self.api_keys or []))
        return self

    @model_validator(mode="after")
    def _adapted_draft_whole(self) -> AppConfig:
        """New draft weights load into a whole draft only (a split one refuses them). With
        retention on, the adaptation deployment runs, and its runs (enabled at run time)
        or a rollback publish new versions: refused with a split draft, even when off."""
        draft = self.engine.draft
        if self.adaptation.retention.enabled and draft and draft.tensor_parallel_size > 1:
            raise ValueError(
                "adaptation.retention.enabled with draft.tensor_parallel_size > 1: adapted "
                "weights load into a whole draft only; keep the draft on one device to adapt "
                "it, or leave retention off"
            )
        return self
