"""What the OpenAI endpoints share: requests to engine calls, engine outputs to responses.

Kept apart from the FastAPI app (:mod:`deployments.openai.server` only wires routes, errors and
limits), as vLLM keeps ``OpenAIServingCompletion``/``OpenAIServingChat`` apart from its
API server. :class:`OpenAIServing` is their shared base (prompt checks, sampling
parameters, the engine call, the speculation report, one request's choices from start to
response); :mod:`~deployments.openai.serving_completion` and
:mod:`~deployments.openai.serving_chat` fill in what differs. Text comes from the engine,
which detokenizes once and matches stop strings on exactly the text returned here; this
layer only shapes it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from deployments.config import AppConfig
from deployments.frontend.engine_client import (
    EngineClient,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestOutput,
)
from deployments.openai.choices import MAX_CHOICES, Choice, start_choices, stop_choices, usage
from deployments.openai.errors import bad_request, check_text, unavailable
from deployments.openai.protocol import Health, SpeculationReport
from deployments.openai.streaming import ClosingStreamingResponse, ResponseStream
from monitoring.domains import DomainResolver
from specdec.sampling import SamplingParams
from specdec.stats import SpecCounts


def engine_health(engine: EngineClient) -> tuple[Health, int]:
    """The engine's health and its status code: 503 while it cannot serve."""
    h = engine.health()
    body = Health(
        status=h["status"],
        target=h["target"],
        draft=h["draft"],
        draft_restarting=h["draft_restarting"],
        target_restarting=h["target_restarting"],
        target_restarts=h["target_restarts"],
        running=h["running"],
        waiting=h["waiting"],
        kv_cache=h["kv_cache"],
        draft_kv_cache=h["draft_kv_cache"],
        aborted=h["aborted"],
        draft_version=h["draft_version"],
        draft_versions=h["draft_versions"],
        draft_channel=h["draft_channel"],
        tensor_parallel=h["tensor_parallel"],
        draft_tensor_parallel=h["draft_tensor_parallel"],
        error=h["error"],
    )
    return body, 503 if body.status == "unavailable" else 200


class OpenAIServing:
    """One endpoint over one engine (per replica); subclasses set the class attributes
    below and implement the hooks that raise :class:`NotImplementedError`.

    ``domains`` is shared by a replica's endpoints: it bounds the traffic domains it has
    seen, whichever endpoint saw them."""

    operation = ""  # the request's kind, as the engine's telemetry names it
    id_prefix = ""  # of the response's id
    prompt_param = "prompt"  # the field a prompt too long for the context is blamed on
    response_cls: Any = None  # the whole response's model
    stream_cls: type[ResponseStream] = ResponseStream

    def __init__(
        self,
        config: AppConfig,
        engine: EngineClient,
        tokenizer,
        domains: DomainResolver | None = None,
    ):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = config.engine.model_name
        self.domains = DomainResolver(config.monitoring) if domains is None else domains

    def check_ready(self) -> None:
        if not self.engine.ready:
            raise unavailable(
                self.engine.health().get("error") or "the engine is not ready; retry shortly"
            )

    # ----- request -> engine ----------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if not prompt:
            raise bad_request("prompt must not be empty", "invalid_value", "prompt")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            if self.tokenizer is None:
                raise bad_request(
                    "this model has no tokenizer: send token ids", "invalid_value", "prompt"
                )
            # As the model's tokenizer does by default, and as vLLM does: BOS in front for
            # Llama and Gemma (their outputs depend on it), nothing for GPT-2 or Qwen.
            # Token-id prompts are taken as given; chat templates render their own BOS
            # and are tokenized without adding another.
            return self.tokenizer(prompt)["input_ids"]
        ids = list(prompt)
        vocab = self.engine.target_info.get("vocab_size")
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            # Checked here too (the engine checks again): echo decodes the ids before the
            # engine sees them, and a tokenizer given an id past 64 bits raises.
            raise bad_request(
                f"prompt token ids must be integers in [0, {vocab})", "invalid_value", "prompt"
            )
        return ids

    def sampling_params(self, req, prompt_len: int) -> SamplingParams:
        """The request's sampling parameters for a prompt of ``prompt_len`` tokens, each
        field checked in turn (the first bad one is the error)."""
        self._check_model(req)
        stop = self._stop_strings(req)
        max_tokens, min_tokens = self._token_limits(req, prompt_len)
        stop_ids = self._stop_token_ids(req)
        logprobs, prompt_logprobs = self.logprobs_params(req)
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            min_tokens=min_tokens,
        )

    def _check_model(self, req) -> None:
        if req.model != self.model_name:
            raise bad_request(
                f"model '{req.model}' does not exist; this server serves '{self.model_name}'",
                "model_not_found",
                "model",
            )

    @staticmethod
    def _stop_strings(req) -> list[str]:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise bad_request("stop must be up to 4 non-empty strings", "invalid_value", "stop")
        for s in stop:
            check_text(s, "stop")
        return stop

    def _token_limits(self, req, prompt_len: int) -> tuple[int, int]:
        """``(max_tokens, min_tokens)``: what is asked, or the default that fits the
        context, checked against the context and each other."""
        context = self.engine.target_info["max_model_len"]
        room = context - prompt_len
        if room < 1:
            raise bad_request(
                f"prompt is {prompt_len} tokens; the context length is {context}",
                "context_length_exceeded",
                self.prompt_param,
            )
        field, asked = self.max_tokens_field(req)
        max_tokens = asked if asked is not None else min(self.config.default_max_tokens, room)
        # max_tokens 0 (echo only): the prompt is scored by the prefill, which also makes
        # one token; the response leaves that token out (see Choice.score_only).
        asked_max = max_tokens  # what min_tokens is checked against (0 with echo)
        max_tokens = max(max_tokens, 1)
        if prompt_len + max_tokens > context:  # (the engine checks it too, without the name)
            raise bad_request(
                f"prompt ({prompt_len} tokens) + {field} ({max_tokens}) exceeds "
                f"the context length {context}",
                "context_length_exceeded",
                field,
            )
        min_tokens = req.min_tokens or 0
        if min_tokens > asked_max:
            raise bad_request(
                f"min_tokens ({min_tokens}) must be <= {field} ({asked_max})",
                "invalid_value",
                "min_tokens",
            )
        return max_tokens, min_tokens

    def _stop_token_ids(self, req) -> list[int]:
        vocab = self.engine.target_info["vocab_size"]
        stop_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_ids):
            raise bad_request(
                f"stop_token_ids must be token ids in [0, {vocab})",
                "invalid_value",
                "stop_token_ids",
            )
        return stop_ids + [t for t in self.implicit_stop_token_ids(req) if t not in stop_ids]

    def speculation_args(self, req) -> dict[str, Any]:
        spec = req.speculation
        limit = self.config.engine.speculation.max_speculative_tokens
        if spec is not None and (spec.num_speculative_tokens or 0) > limit:
            raise bad_request(
                f"num_speculative_tokens must be <= {limit}",
                "invalid_value",
                "speculation.num_speculative_tokens",
            )
        return {
            "speculation": spec.enabled if spec else True,
            "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
            "method": spec.method if spec else None,
        }

    async def _generate(self, prompt_ids, params, args) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one sequence; its errors as :class:`APIError`."""
        stream = self.engine.generate(prompt_ids, params, **args)
        try:
            async for out in stream:
                yield out
        except EngineOverloadedError as exc:
            raise unavailable(str(exc), "overloaded") from exc
        except EngineError as exc:
            raise unavailable(str(exc), "engine_error") from exc
        except InvalidRequestError as exc:  # the engine's checks, shared by every caller
            raise bad_request(str(exc), "invalid_value", exc.param) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        finally:
            await stream.aclose()  # a client that went away frees its sequence now

    # ----- what completions and chat do differently --------------------------------------

    def prompts(self, req) -> list[tuple[list[int], str]]:
        """``(prompt ids, echoed text)`` per prompt of the request."""
        raise NotImplementedError

    def max_tokens_field(self, req) -> tuple[str, int | None]:
        """The field that limits the output, and its value."""
        return "max_tokens", req.max_tokens

    def implicit_stop_token_ids(self, req) -> tuple[int, ...]:
        """Stop tokens the request does not name but its kind implies."""
        return ()

    def logprobs_params(self, req) -> tuple[int | None, int | None]:
        """``(logprobs, prompt_logprobs)``: alternatives per output and prompt token."""
        raise NotImplementedError

    def score_only(self, req) -> bool:
        """Whether the prompt alone is returned (see :attr:`Choice.score_only`)."""
        return False

    def new_logprobs(self, c: Choice) -> Any:
        """A whole response's logprobs of ``c`` before its first output."""
        raise NotImplementedError

    def add_logprobs(self, acc: Any, out: RequestOutput) -> None:
        """Add ``out``'s logprobs to ``acc``."""
        raise NotImplementedError

    def choice_content(self, c: Choice, text: str, logprobs: Any) -> dict[str, Any]:
        """A whole response's choice, besides its index and finish reason."""
        raise NotImplementedError

    # ----- one request, from its choices to its response -----------------------------------

    async def create(self, req, headers: Mapping[str, str] | None = None):
        """The response to ``req``: whole, or streamed once its first choice has started.
        A request refused before then is an :class:`APIError` (a status)."""
        self.check_ready()  # before anything reads the target's facts
        prompts = self.prompts(req)
        n = req.n or 1
        self._check_choice_count(len(prompts), n)
        args = self.speculation_args(req)
        args["domain"] = self.domains.resolve(req.user, req.metadata, headers)
        args["operation"] = self.operation
        # A whole response reads only each choice's first output and its end.
        args["output_kind"] = "delta" if req.stream else "final_only"
        rid = self.id_prefix + uuid.uuid4().hex
        choices = self._choices(req, prompts, n)
        await self._start(choices, args, wait_all=not req.stream)  # errors become statuses
        if req.stream:
            stream = self.stream_cls(self, req, rid, choices, args)
            return ClosingStreamingResponse(
                stream.events(), media_type="text/event-stream", on_close=stream.close
            )
        return await self._whole(rid, choices, args)

    def _check_choice_count(self, prompts: int, n: int) -> None:
        param = "n" if n > 1 else "prompt"
        if prompts * n > MAX_CHOICES:
            raise bad_request(
                f"{prompts} prompt(s) x n = {n} asks for {prompts * n} choices; "
                f"at most {MAX_CHOICES} per request",
                "invalid_value",
                param,
            )
        sched = self.config.engine.scheduler
        if prompts * n > sched.max_num_seqs + sched.max_waiting:
            raise bad_request(
                f"{prompts * n} choices cannot fit this server's queue "
                f"(max_num_seqs {sched.max_num_seqs} + max_waiting {sched.max_waiting})",
                "invalid_value",
                param,
            )

    def _choices(self, req, prompts: list[tuple[list[int], str]], n: int) -> list[Choice]:
        choices = []
        score_only = self.score_only(req)
        for p, (prompt_ids, echo) in enumerate(prompts):
            params = self.sampling_params(req, len(prompt_ids))
            for j in range(n):
                # Choice j of a seeded request draws from seed + j: n copies of one draw
                # would not be n samples.
                seeded = (
                    params
                    if params.seed is None or j == 0
                    else replace(params, seed=(params.seed + j) % 2**63)
                )
                choices.append(Choice(p * n + j, prompt_ids, seeded, echo, p, score_only))
        return choices

    async def _start(self, choices: list[Choice], args: dict[str, Any], wait_all: bool) -> None:
        """Start every choice's sequence; see :func:`start_choices` for what is awaited."""
        for c in choices:
            c.gen = self._generate(c.prompt_ids, c.params, args)
        await start_choices(choices, wait_all)

    async def _whole(self, rid, choices: list[Choice], args):
        tasks = [asyncio.create_task(self._collect(c)) for c in choices]
        try:
            collected = await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others stop and free their sequences
            await stop_choices(tasks, choices)
        lasts = [last for _, last in collected]
        return self.response_cls(
            id=rid,
            created=int(time.time()),
            model=self.model_name,
            choices=[choice for choice, _ in collected],
            usage=usage(choices, lasts),
            speculation=self.report_many(lasts, args, choices[0].params),
        )

    async def _collect(self, c: Choice) -> tuple[dict[str, Any], Any]:
        """One choice of a non-streamed response, and its last output."""
        text, last = c.echo, c.first
        logprobs = self.new_logprobs(c)
        out = c.first
        try:
            while out is not None:
                last = out
                if c.score_only:  # the prefill's token is not part of the answer
                    break
                if c.params.logprobs is not None:
                    self.add_logprobs(logprobs, out)
                text += out.text or ""
                out = await c.gen.__anext__() if not out.finished else None
        except StopAsyncIteration:
            pass
        finally:
            await c.gen.aclose()
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason(last)}
        choice.update(self.choice_content(c, text, logprobs))
        return choice, last

    # ----- engine -> speculation report ----------------------------------------------------

    def report(
        self, out: RequestOutput | None, args: dict[str, Any], params: SamplingParams
    ) -> SpeculationReport:
        """What speculation did for one choice; its k and policy by the engine's own rule
        (:meth:`SpeculationConfig.draft_plan`)."""
        s = out.stats if out else None
        has_draft = self.engine.config.draft is not None
        plan = self.config.engine.speculation.draft_plan(
            args["speculation"],
            args["num_speculative_tokens"],
            params.seed is not None,
            has_draft,
            args.get("method"),
        )
        by_method = {
            "draft_model": (s.rounds - s.ngram_rounds) if s else 0,
            "ngram": s.ngram_rounds if s else 0,
        }
        used = {m: n for m, n in by_method.items() if n}
        return SpeculationReport(
            enabled=args["speculation"] and (has_draft or plan.method == "ngram"),
            num_speculative_tokens=plan.k,
            policy="goodput" if plan.auto_k or plan.auto_method else "fixed",
            method=max(used, key=used.get) if used else "none",
            proposer_rounds=used,
            ngram_drafted=s.ngram_drafted if s else 0,
            ngram_accepted=s.ngram_accepted if s else 0,
            domain=args.get("domain", "default"),
            drafted=s.drafted if s else 0,
            accepted=s.accepted if s else 0,
            acceptance_rate=round(s.acceptance_rate, 4) if s else 0.0,
            mean_acceptance_length=round(s.mean_acceptance_length, 4) if s else 0.0,
            rounds=s.rounds if s else 0,
            cache_hits=s.cache_hits if s else 0,
        )

    def report_many(self, lasts: list[Any], args, params: SamplingParams) -> SpeculationReport:
        """The speculation report of several choices: their counts summed."""
        if len(lasts) == 1:
            return self.report(lasts[0], args, params)
        stats = SpecCounts()
        for last in lasts:
            if last is not None:
                stats.add(last.stats)
        total = RequestOutput("", [], True, None, 0, 0, stats)
        return self.report(total, args, params)
