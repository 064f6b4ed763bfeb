"""Every message that crosses a process boundary between the replica (frontend), the engine
core and the draft worker: one small named type each, with the unit and shape of every
field, so that neither end indexes a tuple the other built.

Who sends what (docs/architecture.md, "Messages", has the table with sizes):

- frontend -> core: :class:`EngineCoreRequest` (``EngineCore.add_requests``), request ids
  to abort, :class:`DriftAlert` (``on_drift``);
- core -> frontend: :class:`EngineCoreOutputs` of :class:`EngineCoreOutput`
  (``get_outputs``, a long-poll), :class:`TelemetrySnapshot` (``drain_telemetry``);
- core -> draft: :class:`DraftRoundMessage` of :class:`DraftItem`
  (``DraftWorker.on_round``, or one Compiled Graph step);
- draft -> core: :class:`DraftPush` of :class:`PushedDraft` (``push_drafts``, or the
  step's reply);
- frontend -> either actor, once: :class:`EngineCoreConfig`, :class:`DraftWorkerConfig`.

A leaf module: it imports nothing of the project but ``specdec``. The types are frozen
``msgspec.Struct``s: built in about a tenth of a frozen dataclass's time (the core builds
several per row per round, on its critical path).

The three messages of every round (:class:`EngineCoreOutputs`, :class:`DraftRoundMessage`,
:class:`DraftPush`) cross as bytes: :func:`encode` writes them as MessagePack arrays (field
order, no names; ``array_like``) and :func:`decode` reads them back as the named type. The
``specdec`` dataclasses inside (``SpecCounts``, ``CompactQ``) keep their field names:
``specdec`` does without msgspec, so that it runs where only torch is installed.
Why not let Ray pickle them: Ray sends plain values (lists, numbers, bytes) through its own
MessagePack, but any other object through cloudpickle, which looks up every class of a
message anew for each call; for a round's output at batch 16 that was 26 us against 3 us
for the same fields as tuples, paid on the core's critical path. Encoded, the same output
takes about 3 us and Ray moves the bytes as they are. Arrays (a sampled row's ``q``) travel
beside the bytes, as numpy arrays Ray moves without a copy. The other messages (a request's
start, the telemetry snapshot, the configs) are rare and travel as pickled objects.
"""

from __future__ import annotations

from enum import Enum
from functools import partial
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from specdec.policy import LengthPolicyConfig
from specdec.proposer_choice import ProposerChoiceConfig
from specdec.qcodec import CompactQ
from specdec.stats import RowOutcome, SpecCounts

__all__ = [
    "ChannelAddress",
    "ColocatedDraftConfig",
    "DraftItem",
    "DraftPush",
    "DraftRestart",
    "DraftRoundMessage",
    "DraftStatus",
    "DraftWorkerConfig",
    "DriftAlert",
    "EngineCoreConfig",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "OutputsRequest",
    "PushedDraft",
    "RoundFeedback",
    "RowOutcome",
    "SpecCounts",
    "TelemetrySnapshot",
    "TokenLogprob",
    "decode",
    "encode",
]

SeqId = str  # a request's id (the frontend refuses any other type)


# ----- frontend <-> core --------------------------------------------------------------------


# What a request's client reads: "delta", every round's new tokens as they commit;
# "final_only", its first output, then the rest at once when it ends
# (deployments/core/output_hold.py).
OutputKind = Literal["delta", "final_only"]


class EngineCoreRequest(msgspec.Struct, frozen=True):
    """Start a request in the core, or resume one a replaced core had committed tokens of."""

    request_id: SeqId  # the engine's id for it (the caller's, "#" and a count, when it gave one)
    prompt_token_ids: list[int]  # [prompt_len]
    output_token_ids: list[int]  # [committed]: non-empty resumes the request after them
    sampling_params: dict[str, Any]  # specdec.sampling.SamplingParams fields (asdict)
    num_speculative_tokens: int  # k per round; with ``auto_k``, its upper bound
    domain: str  # the traffic domain (policy and telemetry key)
    auto_k: bool  # the length policy chooses k each round
    method: str = "draft_model"  # the proposer: "draft_model" or "ngram" (no draft involved)
    auto_method: bool = False  # the proposer choice picks it per round (method: the first)
    output_kind: OutputKind = "delta"  # when its outputs are published (see OutputKind)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's log-probability under the target's raw distribution (before the
    request's temperature, filters and penalties, as vLLM reports them)."""

    logprob: float | None  # None: nothing to report (a prompt's first token)
    top: dict[int, float] | None  # token id -> logprob, likeliest first ({} if none asked)


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True):
    """What one round (or a prefill) committed for one request."""

    request_id: SeqId
    new_token_ids: list[int]  # [new]: committed this round, after EOS/stop-id cuts
    finished: bool
    finish_reason: str | None  # "stop", "length", "error" or None while running
    num_output_tokens: int  # committed so far, these included
    spec_counts: SpecCounts  # the request's speculation so far (a copy)
    error: str | None = None  # set: the request failed alone in the core
    logprobs: list[TokenLogprob] | None = None  # [new], when the request asked for them
    # [prompt_len - 1]: the prompt's tokens after the first, on a scoring request's first
    # output
    prompt_logprobs: list[TokenLogprob] | None = None


class EngineCoreOutputs(msgspec.Struct, frozen=True, array_like=True):
    """One long-poll's answer: outputs after the caller's cursor."""

    cursor: int  # pass it back next time: outputs before it are acknowledged and dropped
    outputs: list[EngineCoreOutput]
    error: str | None = None  # the core's loop failed: every request ends with it
    # how long the core's loop has been busy without committing a model pass, 0 while it
    # waits for work: a stuck device call leaves the polls answered but this growing [s]
    stalled_s: float = 0.0


class DriftAlert(msgspec.Struct, frozen=True):
    """The monitor's drift alert for a domain, handed to the core's length policy."""

    domain: str
    current_alpha: float  # α̂ the detector estimates now (docs/architecture.md, Formulas)


class TelemetrySnapshot(msgspec.Struct, frozen=True):
    """The core's round records since the last drain, and its batch state, for the monitor."""

    rounds: list[RowOutcome]  # one per drafted row per round, oldest first
    committed: dict[str, int]  # domain -> tokens committed [tokens]
    verify_s: list[float]  # per engine round [s]
    draft_wait_s: list[float]  # per engine round [s]
    overhead_s: list[float]  # per engine round [s]
    dropped: int  # drafted rows dropped from the bounded buffer since the last drain
    running: int  # sequences in the batch
    waiting: int  # requests queued for a KV slot
    kv_cache_usage: float  # the target's KV slots in use / allocated
    kv_cache_token_usage: float  # tokens held / (slots x max_model_len)
    policy: dict[str, dict]  # domain -> the length policy's choice (SpeculationLength.state)


# ----- core <-> draft ----------------------------------------------------------------------


class DraftRestart(msgspec.Struct, frozen=True, array_like=True):
    """A sequence the draft must (re)start from scratch: new, new to this draft, or lost."""

    prompt_token_ids: list[int]  # [prompt_len]
    output_token_ids: list[int]  # [committed]: penalties count them apart from the prompt
    sampling_params: dict[str, Any]  # SamplingParams fields (asdict)


class DraftItem(msgspec.Struct, frozen=True, array_like=True):
    """One row of a round message: what the last round committed, what is wanted next."""

    seq_id: SeqId
    base_len: int  # committed tokens before ``new_token_ids`` [tokens]
    new_token_ids: list[int]  # [new]: committed by the round that just ended
    num_speculative_tokens: int  # drafts wanted for the next round (0: none)
    restart: DraftRestart | None = None  # set: forget what you hold, start from this


class RoundFeedback(msgspec.Struct, frozen=True, array_like=True):
    """What the draft's speculation-width policy learns from the round that just ended."""

    verify_s: float | None  # decayed mean of the target's verification time [s]
    round_s: float | None  # the round's wall time [s]; None: not a round (an admission)
    committed_tokens: int  # tokens the round committed, over all rows [tokens]
    # Whether the round's goodput may judge speculating while verifying: False for a cost
    # measurement at a k the length policy forced (0, 1 or the longest, a few rounds) and
    # the round after it (drafts prepared at that k), a round with no drafted rows, or
    # one whose rows resumed drafting (their draft prefilled first). Counted, such rounds
    # are charged to whichever width choice is being measured then.
    representative: bool = True


class DraftRoundMessage(msgspec.Struct, frozen=True, array_like=True):
    """The core's one message to the draft per round (and per admission or abort)."""

    msg_no: int  # grows with time: a replacement core's numbers exceed its predecessor's
    first: bool  # the first message to this draft: drop everything held
    round_for: int  # the round the wanted drafts are for
    items: list[DraftItem]
    freed: list[SeqId]  # sequences that ended or left the draft
    feedback: RoundFeedback


class DraftStatus(str, Enum):
    """What a pushed row says (an explicit field, never a sentinel in the guess)."""

    DRAFTS = "drafts"  # drafts for the round in which the row committed ``guess``
    LOST = "lost"  # the draft lost track of the row: send it in full (DraftRestart)
    GAVE_UP = "gave_up"  # drafting failed for this row alone: decode it target-only


class PushedDraft(msgspec.Struct, frozen=True, array_like=True):
    """One row's drafts, keyed by the outcome they continue."""

    seq_id: SeqId
    status: DraftStatus
    guess: tuple[int, ...] = ()  # the tokens the previous round must have committed
    token_ids: list[int] | None = None  # [k']: the drafts (k' <= k: a confidence stop)
    q: CompactQ | None = None  # sampled rows: the 16-bit distribution each was drawn from
    speculative: bool = False  # prepared ahead, while the previous round was verified
    draft_version: int = 0  # the draft weights' version that made them (0: as deployed)


class DraftPush(msgspec.Struct, frozen=True, array_like=True):
    """Drafts from the draft to the core, for one round."""

    round_for: int  # the round they are for (older than the core's: dropped)
    drafts: list[PushedDraft]


# ----- actor construction (frontend -> core, frontend -> draft) -----------------------------


class ColocatedDraftConfig(msgspec.Struct, frozen=True):
    """A draft the core runs in its own process (``draft_placement: colocated``)."""

    spec: dict[str, Any]  # deployments.config.ModelSpec fields (model_dump)
    min_confidence: float  # speculation.draft_confidence_threshold
    tokenizer_size: int | None  # len(tokenizer): proposals stay below it (None: no limit)


class EngineCoreConfig(msgspec.Struct, frozen=True):
    """What :class:`deployments.core.engine_core.EngineCore` is built from."""

    spec: dict[str, Any]  # the target's ModelSpec fields (model_dump)
    max_num_seqs: int  # sequences in one batch
    eos_token_ids: list[int]  # the tokenizer's; the core adds generation_config's
    draft_timeout_s: float  # longest wait for a round's drafts [s]
    draft_max_model_len: int | None = None  # the draft's context (None: the target's)
    transport: str = "actor"  # "actor" or "compiled_graph" messages to a draft actor
    direct_channel: bool = True  # transport "actor": round messages over a direct connection
    length_policy: LengthPolicyConfig | None = None  # None: every request at its fixed k
    telemetry: bool = False  # keep round records for drain_telemetry (a monitor runs)
    colocated_draft: ColocatedDraftConfig | None = None  # None: a draft actor connects
    cpu_affinity: list[int] | None = None  # [cores] the loop thread runs on (None: any)
    # None: each request keeps its proposer; else the per-domain choice between them
    proposer_choice: ProposerChoiceConfig | None = None
    ngram_max: int = 4  # n-gram lookup: the longest suffix matched [tokens]
    ngram_min: int = 1  # ... the shortest [tokens]
    # A tensor-parallel target's ranks 1 .. N - 1 (TensorParallelRank actor handles, started
    # by the launcher, joined by the core at load); empty: the target is whole here.
    ranks: list[Any] = msgspec.field(default_factory=list)
    rank_timeout_s: float = 30.0  # longest wait in a pass for the other ranks [s]


class RankConfig(msgspec.Struct, frozen=True):
    """What a :class:`deployments.workers.tensor_parallel_rank.TensorParallelRank` is built
    from: its model's spec, loaded as rank 0 (the engine core for the target, the draft
    worker for a draft) loads it, and its place in the group."""

    spec: dict[str, Any]  # the split model's ModelSpec fields (model_dump)
    rank: int  # 1 .. world_size - 1 (the core or the draft worker is rank 0)
    world_size: int  # the model's tensor_parallel_size
    max_num_seqs: int  # KV slots (the KV plan, as rank 0's)
    timeout_s: float  # longest wait in a pass for the other ranks [s]
    cpu_affinity: list[int] | None = None  # [cores] its thread runs on (None: any)
    verifies: bool = True  # False for a draft: no every-position logits in its reserve
    role: str = "target"  # "target" or "draft": which model's rank (names it for operators)


class OutputsRequest(msgspec.Struct, frozen=True):
    """A replica's long-poll for its core's outputs over the direct channel (the same
    question as ``EngineCore.get_outputs``; the answer is an encoded
    :class:`EngineCoreOutputs`)."""

    cursor: int  # outputs before it are acknowledged (the core drops them)
    timeout_s: float  # longest wait for an output [s]


class ChannelAddress(msgspec.Struct, frozen=True):
    """Where a draft actor's direct channel listens (:mod:`deployments.workers.channel`),
    given to its core over Ray; ``token`` is the secret a connection must show first."""

    host: str  # the draft's node address
    port: int  # TCP port
    token: bytes  # 32 random bytes, compared in constant time

    def __repr__(self) -> str:  # the token stays out of logs
        return f"ChannelAddress({self.host!r}, {self.port})"


class DraftWorkerConfig(msgspec.Struct, frozen=True):
    """What :class:`deployments.workers.draft_worker.DraftWorker` is built from."""

    spec: dict[str, Any]  # the draft's ModelSpec fields (model_dump)
    max_num_seqs: int  # sequences the core runs at once (a KV slot kept for each)
    speculation_width: int  # outcomes prepared per sequence while the target verifies
    overlap: bool  # draft ahead while the target verifies
    adaptive_overlap: bool = True  # adapt the width to hits and time (SpeculationWidth)
    transport: str = "actor"  # "compiled_graph": drafts go back as the step's reply
    min_confidence: float = 0.0  # stop a row's drafts below this draft probability
    cpu_affinity: list[int] | None = None  # [cores] the loop thread runs on (None: any)
    # A split draft's ranks 1 .. M - 1 (TensorParallelRank actor handles, started by the
    # launcher, joined by the worker at load); empty: the draft is whole here.
    ranks: list[Any] = msgspec.field(default_factory=list)
    rank_timeout_s: float = 30.0  # longest wait in a pass for the other ranks [s]


# ----- the wire: the round's messages as bytes (and arrays) ---------------------------------

M = TypeVar("M", EngineCoreOutputs, DraftRoundMessage, DraftPush)
# What travels: the message's bytes, and beside them its arrays (a sampled row's ``q``), which
# Ray moves out of band without a copy (inline, 40 MB of q at batch 32 took 4x as long).
Wire = bytes | tuple[bytes, list[np.ndarray]]


def _array_index(arrays: list[np.ndarray], obj: Any) -> Any:
    """Encoding hook: an array goes into ``arrays``; the message keeps its index."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return len(arrays) - 1
    raise NotImplementedError(f"no wire form for {type(obj).__name__}")


def _array_at(arrays: list[np.ndarray], type_: type, obj: Any) -> Any:
    """Decoding hook: the array at the index the message kept."""
    if type_ is np.ndarray:
        return arrays[obj]
    raise NotImplementedError(f"no wire form for {type_.__name__}")


_DECODERS = {
    cls: msgspec.msgpack.Decoder(cls) for cls in (EngineCoreOutputs, DraftRoundMessage, DraftPush)
}


def encode(msg: EngineCoreOutputs | DraftRoundMessage | DraftPush) -> Wire:
    """One of the round's messages as it travels: its bytes, or its bytes and its arrays
    (see the module docstring). An encoder per call: its hook collects this call's arrays
    (0.2 us to build), and the core encodes from several threads."""
    arrays: list[np.ndarray] = []
    data = msgspec.msgpack.Encoder(enc_hook=partial(_array_index, arrays)).encode(msg)
    return (data, arrays) if arrays else data


def decode(cls: type[M], wire: Wire) -> M:
    """The message of type ``cls`` that :func:`encode` wrote (Ray hands a tuple back as a
    list)."""
    if isinstance(wire, (bytes, bytearray, memoryview)):  # (a channel frame: bytearray)
        return _DECODERS[cls].decode(wire)
    data, arrays = wire
    return msgspec.msgpack.Decoder(cls, dec_hook=partial(_array_at, arrays)).decode(data)
