"""The OpenAI endpoints' logic: requests to engine calls, engine outputs to responses.

Kept apart from the FastAPI app (:mod:`deployments.openai.server` only wires routes, errors and
limits), as vLLM keeps ``OpenAIServingCompletion``/``OpenAIServingChat`` apart from its
API server. Text comes from the engine, which detokenizes once and matches stop strings
on exactly the text returned here; this module only shapes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi.responses import StreamingResponse

from deployments.config import AppConfig
from deployments.frontend.engine_client import (
    EngineClient,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestOutput,
    RequestStats,
)
from deployments.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionResponse,
    Health,
    SpeculationReport,
    Usage,
)
from monitoring.domains import DomainResolver
from specdec.sampling import SamplingParams

logger = logging.getLogger("specserve.openai")

RETRY_AFTER_S = 5  # what a 503 tells clients to wait before retrying


class APIError(Exception):
    """An error to send in OpenAI's shape; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, type_: str, code=None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}


def bad_request(message: str, code: str | None = None, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def unavailable(message: str, code: str = "unavailable") -> APIError:
    return APIError(503, message, "service_unavailable", code)


def check_text(text: str, param: str) -> None:
    """JSON may carry lone UTF-16 surrogates (``"\\ud800"``): no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{param} is not valid Unicode text (lone surrogate at {exc.start})",
            "invalid_value",
            param,
        ) from None


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The special token(s) the chat template puts right after an assistant's text.

    Rendering a conversation with and without a final assistant turn shows what the
    template appends to a turn; its first special token ends the turn (``<|end|>``,
    ``<|eot_id|>``, ``<|im_end|>``), so generation must stop there.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ()
    marker = "SpecServeTurnMarker"
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=True,
            return_dict=False,
        )
    except Exception:  # a template that cannot render this: rely on the EOS ids
        return ()
    special = set(getattr(tokenizer, "all_special_ids", []))
    text = ""
    for i, tok in enumerate(ids):
        text += tokenizer.decode([tok])
        if marker in text:
            after = [t for t in ids[i + 1 :] if t in special]
            return tuple(after[:1])
    return ()


class OpenAIServing:
    """Completions and chat completions over one engine (per replica)."""

    def __init__(self, config: AppConfig, engine: EngineClient, tokenizer):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = config.engine.model_name
        self.chat_stop_ids = end_of_turn_ids(tokenizer)
        self.domains = DomainResolver(config.monitoring)

    # ----- health -------------------------------------------------------------------------

    def health(self) -> tuple[Health, int]:
        h = self.engine.health()
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
            error=h["error"],
        )
        return body, 503 if body.status == "unavailable" else 200

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

    def encode_chat(self, req: ChatCompletionRequest) -> list[int]:
        messages = []
        for i, m in enumerate(req.messages):
            text = m.text()
            check_text(text, f"messages.{i}.content")
            role = "system" if m.role == "developer" else m.role
            message = {"role": role, "content": text}
            # Templates that know these render them (as vLLM passes them); others ignore.
            message.update(
                {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v}
            )
            messages.append(message)
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                "this model has no chat template: use /v1/completions",
                "unsupported_value",
                "messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # e.g. a template that refuses a role or an order
            raise bad_request(
                f"the chat template cannot render these messages: {exc}",
                "invalid_value",
                "messages",
            ) from None

    def sampling_params(self, req, prompt_len: int, chat: bool) -> SamplingParams:
        if req.model != self.model_name:
            raise bad_request(
                f"model '{req.model}' does not exist; this server serves '{self.model_name}'",
                "model_not_found",
                "model",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise bad_request("stop must be up to 4 non-empty strings", "invalid_value", "stop")
        for s in stop:
            check_text(s, "stop")
        context = self.engine.target_info["max_model_len"]
        room = context - prompt_len
        if room < 1:
            raise bad_request(
                f"prompt is {prompt_len} tokens; the context length is {context}",
                "context_length_exceeded",
                "messages" if chat else "prompt",
            )
        field = "max_tokens"
        asked = req.max_tokens
        if chat and req.max_completion_tokens is not None:
            field, asked = "max_completion_tokens", req.max_completion_tokens
        max_tokens = asked if asked is not None else min(self.config.default_max_tokens, room)
        # max_tokens 0 (echo only): the prompt is scored by the prefill, which also makes
        # one token; the response leaves that token out (see _Choice.score_only).
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
        vocab = self.engine.target_info["vocab_size"]
        stop_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_ids):
            raise bad_request(
                f"stop_token_ids must be token ids in [0, {vocab})",
                "invalid_value",
                "stop_token_ids",
            )
        if chat and not req.ignore_eos:  # the template's end of turn ends a chat reply
            stop_ids += [t for t in self.chat_stop_ids if t not in stop_ids]
        # Chat asks with a flag and a count, completions with a count alone.
        chat_logprobs = (req.top_logprobs or 0) if chat and req.logprobs else None
        logprobs = chat_logprobs if chat else req.logprobs
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
            prompt_logprobs=req.logprobs if not chat and req.echo else None,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            min_tokens=min_tokens,
        )

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
        }

    async def _run(self, prompt_ids, params, args) -> AsyncIterator[RequestOutput]:
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

    # ----- engine -> response -----------------------------------------------------------------

    def report(
        self, out: RequestOutput | None, args: dict[str, Any], params: SamplingParams
    ) -> SpeculationReport:
        s = out.stats if out else None
        k = args["num_speculative_tokens"]
        enabled = args["speculation"] and self.engine.config.draft is not None
        default_k = self.config.engine.speculation.num_speculative_tokens
        # Seeded requests run at the fixed k (the policy's timing-driven k would not repeat).
        auto = enabled and k is None and params.seed is None
        policy = self.config.engine.speculation.policy if auto else "fixed"
        return SpeculationReport(
            enabled=enabled,
            num_speculative_tokens=(default_k if k is None else k) if enabled else 0,
            policy=policy,
            domain=args.get("domain", "default"),
            drafted=s.drafted if s else 0,
            accepted=s.accepted if s else 0,
            acceptance_rate=round(s.acceptance_rate, 4) if s else 0.0,
            mean_acceptance_length=round(s.mean_acceptance_length, 4) if s else 0.0,
            rounds=s.rounds if s else 0,
            cache_hits=s.cache_hits if s else 0,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def chat_logprobs(self, out: RequestOutput) -> list[dict[str, Any]]:
        entries = []
        for tok, (lp, top) in zip(out.new_token_ids, out.logprobs or [], strict=False):
            text = self._token_text(tok)
            entries.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := self._token_text(i)),
                            "logprob": v,
                            "bytes": list(t.encode("utf-8")),
                        }
                        for i, v in top
                    ],
                }
            )
        return entries

    @staticmethod
    def new_completion_logprobs(start: int) -> dict[str, Any]:
        """An empty completions-logprobs record whose next token starts at ``start``."""
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {**{k: [] for k in keys}, "_end": start}

    def completion_logprobs(self, out: RequestOutput, acc: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's completions logprobs for ``out``'s tokens, appended to ``acc``.

        ``text_offset`` is where each token's text starts, counted over the token texts
        themselves (the echoed prompt first): the released text may lag behind them while
        a stop string could still complete, so it cannot be the reference.
        """
        return self._append_logprobs(acc, out.new_token_ids, out.logprobs or [])

    def prompt_completion_logprobs(
        self, prompt_ids: list[int], first: RequestOutput | None
    ) -> dict[str, Any]:
        """A completions-logprobs record that starts with the prompt's tokens (echo with
        logprobs): the first one's logprob and alternatives are null, nothing precedes it."""
        scored = (first.prompt_logprobs if first is not None else None) or []
        scored = [(None, None), *scored, *[(None, None)] * (len(prompt_ids) - 1 - len(scored))]
        return self._append_logprobs(self.new_completion_logprobs(0), prompt_ids, scored)

    def _append_logprobs(
        self, acc: dict[str, Any], token_ids: list[int], scored: list[tuple]
    ) -> dict[str, Any]:
        """Append each token with its ``(logprob, [(id, logprob), ...])`` (``(None, None)``:
        nothing to report) to ``acc``; offsets continue from ``acc["_end"]``."""
        offset = acc["_end"]
        for tok, (lp, top) in zip(token_ids, scored, strict=False):
            text = self._token_text(tok)
            acc["tokens"].append(text)
            acc["token_logprobs"].append(lp)
            acc["top_logprobs"].append(
                None if top is None else {self._token_text(i): v for i, v in top}
            )
            acc["text_offset"].append(offset)
            offset += len(text)
        acc["_end"] = offset
        return acc

    @staticmethod
    def _public(acc: dict[str, list]) -> dict[str, list]:
        return {k: v for k, v in acc.items() if not k.startswith("_")}

    def _prompts(self, req, chat: bool) -> list[tuple[list[int], str]]:
        """``(prompt ids, echoed text)`` per prompt: one for chat; for completions a text,
        a token list, or a batch of either (one choice per prompt, as lm-eval sends)."""
        if chat:
            return [(self.encode_chat(req), "")]
        batch = req.prompt if _is_batch(req.prompt) else [req.prompt]
        if not batch:
            raise bad_request("prompt must not be empty", "invalid_value", "prompt")
        if len(batch) > MAX_CHOICES:
            raise bad_request(
                f"at most {MAX_CHOICES} prompts per request", "invalid_value", "prompt"
            )
        out = []
        for prompt in batch:
            ids = self.encode_prompt(prompt)
            echo = ""
            if req.echo:
                if isinstance(prompt, str):
                    echo = prompt
                elif self.tokenizer is not None:
                    echo = self.tokenizer.decode(prompt)
                else:
                    raise bad_request(
                        "echo needs a tokenizer to turn token ids into text",
                        "invalid_value",
                        "echo",
                    )
            out.append((ids, echo))
        return out

    async def create(self, req, chat: bool, headers: Mapping[str, str] | None = None):
        self.check_ready()  # before anything reads the target's facts
        prompts = self._prompts(req, chat)
        n = req.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(
                f"{len(prompts)} prompt(s) x n = {n} asks for {len(prompts) * n} choices; "
                f"at most {MAX_CHOICES} per request",
                "invalid_value",
                "n" if n > 1 else "prompt",
            )
        sched = self.config.engine.scheduler
        if len(prompts) * n > sched.max_num_seqs + sched.max_waiting:
            raise bad_request(
                f"{len(prompts) * n} choices cannot fit this server's queue "
                f"(max_num_seqs {sched.max_num_seqs} + max_waiting {sched.max_waiting})",
                "invalid_value",
                "n" if n > 1 else "prompt",
            )
        args = self.speculation_args(req)
        args["domain"] = self.domains.resolve(req.user, req.metadata, headers)
        args["operation"] = "chat" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = []
        for p, (prompt_ids, echo) in enumerate(prompts):
            params = self.sampling_params(req, len(prompt_ids), chat)
            for j in range(n):
                # Choice j of a seeded request draws from seed + j: n copies of one draw
                # would not be n samples.
                seeded = (
                    params
                    if params.seed is None or j == 0
                    else replace(params, seed=(params.seed + j) % 2**63)
                )
                choices.append(
                    _Choice(
                        p * n + j, prompt_ids, seeded, echo, p, not chat and req.max_tokens == 0
                    )
                )
        await self._start(choices, args, wait_all=not req.stream)  # errors become statuses
        if req.stream:
            return StreamingResponse(
                self._events(req, rid, choices, args, chat),
                media_type="text/event-stream",
            )
        return await self._whole(rid, choices, args, chat)

    async def _start(self, choices: list[_Choice], args: dict[str, Any], wait_all: bool) -> None:
        """Start every choice's sequence and wait for the first output of each
        (``wait_all``), or of the first only (a stream: the others' first outputs come
        through the stream as their sequences are admitted), so that a refused request
        becomes a status. On any failure, or cancellation, every sequence is freed."""
        for c in choices:
            c.gen = self._run(c.prompt_ids, c.params, args)

        async def first(c: _Choice) -> None:
            try:
                c.first = await c.gen.__anext__()
            except StopAsyncIteration:
                c.first = None
            c.started = True

        tasks = [asyncio.create_task(first(c)) for c in (choices if wait_all else choices[:1])]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            await _stop(tasks, choices)
            raise

    async def _collect(self, c: _Choice, chat: bool) -> tuple[dict[str, Any], Any]:
        """One choice of a non-streamed response, and its last output."""
        text, last = c.echo, c.first
        chat_lps: list[dict[str, Any]] = []
        comp_lps = self.new_completion_logprobs(len(c.echo))
        if c.params.prompt_logprobs is not None:
            comp_lps = self.prompt_completion_logprobs(c.prompt_ids, c.first)
        out = c.first
        try:
            while out is not None:
                last = out
                if c.score_only:  # the prefill's token is not part of the answer
                    break
                if c.params.logprobs is not None:
                    if chat:
                        chat_lps += self.chat_logprobs(out)
                    else:
                        self.completion_logprobs(out, comp_lps)
                text += out.text or ""
                out = await c.gen.__anext__() if not out.finished else None
        except StopAsyncIteration:
            pass
        finally:
            await c.gen.aclose()
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason(last),
        }
        if chat:
            choice["message"] = {"content": text}
            if c.params.logprobs is not None:
                choice["logprobs"] = {"content": chat_lps}
        else:
            choice["text"] = text
            if c.params.logprobs is not None:
                choice["logprobs"] = self._public(comp_lps)
        return choice, last

    @staticmethod
    def _usage(choices: list[_Choice], lasts: list[Any]) -> Usage:
        """Prompt tokens once per prompt (its n choices share it), output tokens of all."""
        prompt = sum({c.prompt_index: len(c.prompt_ids) for c in choices}.values())
        out = sum(
            last.num_output_tokens
            for c, last in zip(choices, lasts, strict=True)
            if last is not None and not c.score_only
        )
        return Usage(prompt_tokens=prompt, completion_tokens=out, total_tokens=prompt + out)

    async def _whole(self, rid, choices: list[_Choice], args, chat):
        tasks = [asyncio.create_task(self._collect(c, chat)) for c in choices]
        try:
            collected = await asyncio.gather(*tasks)
        finally:  # one failed (or the client left): the others stop and free their sequences
            await _stop(tasks, choices)
        lasts = [last for _, last in collected]
        response = ChatCompletionResponse if chat else CompletionResponse
        return response(
            id=rid,
            created=int(time.time()),
            model=self.model_name,
            choices=[choice for choice, _ in collected],
            usage=self._usage(choices, lasts),
            speculation=self.report_many(lasts, args, choices[0].params),
        )

    def report_many(self, lasts: list[Any], args, params: SamplingParams) -> SpeculationReport:
        """The speculation report of several choices: their counts summed."""
        if len(lasts) == 1:
            return self.report(lasts[0], args, params)
        stats = RequestStats()
        for last in lasts:
            if last is not None:
                for name in ("drafted", "accepted", "rounds", "cache_hits"):
                    setattr(stats, name, getattr(stats, name) + getattr(last.stats, name))
        total = RequestOutput("", [], True, None, 0, 0, stats)
        return self.report(total, args, params)

    async def _events(self, req, rid, choices: list[_Choice], args, chat):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        # vLLM's continuous usage: only together with include_usage, on every chunk that
        # carries a choice: that choice's prompt and the tokens it has generated so far.
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)

        def chunk(parts: list[dict], extra: dict | None = None) -> str:
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": parts,
            }
            body.update(extra or {})
            return f"data: {json.dumps(body)}\n\n"

        token_end = {c.index: len(c.echo) for c in choices}  # next token's text_offset

        def so_far(c: _Choice, out: RequestOutput | None) -> dict | None:
            if not continuous:
                return None
            prompt, done = (
                len(c.prompt_ids),
                out.num_output_tokens if out and not c.score_only else 0,
            )
            usage = Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
            return {"usage": usage.model_dump()}

        def piece(c: _Choice, out: RequestOutput | None, text: str):
            if chat:
                part: dict[str, Any] = {"index": c.index, "delta": {"content": text}}
                if c.params.logprobs is not None and out is not None:
                    part["logprobs"] = {"content": self.chat_logprobs(out)}
            else:
                part = {"index": c.index, "text": text, "logprobs": None}
                if c.params.logprobs is not None and out is not None:
                    lps = self.completion_logprobs(
                        out, self.new_completion_logprobs(token_end[c.index])
                    )
                    token_end[c.index] = lps["_end"]
                    part["logprobs"] = self._public(lps)
            part["finish_reason"] = None
            return part

        def end(c: _Choice, last) -> str:
            done = {"index": c.index, "finish_reason": c.finish_reason(last)}
            done.update({"delta": {}} if chat else {"text": "", "logprobs": None})
            report = self.report(last, args, c.params).model_dump()
            return chunk([done], {"speculation": report, **(so_far(c, last) or {})})

        # Each choice's outputs are pumped into one queue, so choices stream as they come.
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                out = c.first if c.started else await c.gen.__anext__()
            except StopAsyncIteration:
                out = None
            except Exception as exc:
                await queue.put((c, exc))
                return
            try:
                while out is not None:
                    await queue.put((c, out))
                    out = await c.gen.__anext__() if not out.finished else None
            except StopAsyncIteration:
                pass
            except Exception as exc:
                await queue.put((c, exc))
                return
            await queue.put((c, None))

        lasts: dict[int, Any] = {c.index: c.first for c in choices}
        tasks: list[asyncio.Task] = []
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                for c in choices:
                    part = {"index": c.index, "delta": role, "finish_reason": None}
                    yield chunk([part], so_far(c, None))
            # The echo goes first; with prompt logprobs it waits for the first output,
            # which carries them.
            unechoed = set()
            for c in choices:
                if c.params.prompt_logprobs is not None:
                    unechoed.add(c.index)
                elif c.echo:
                    yield chunk([piece(c, None, c.echo)], so_far(c, None))
            tasks = [asyncio.create_task(pump(c)) for c in choices]
            open_choices = len(choices)
            while open_choices:
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if c.index in unechoed:
                    unechoed.discard(c.index)
                    lps = self.prompt_completion_logprobs(c.prompt_ids, item)
                    token_end[c.index] = lps["_end"]
                    yield chunk([{**piece(c, None, c.echo), "logprobs": self._public(lps)}])
                if item is None:
                    open_choices -= 1
                    yield end(c, lasts[c.index])
                    continue
                lasts[c.index] = item
                text = item.text or ""
                if (text or item.logprobs) and not c.score_only:
                    yield chunk([piece(c, item, text)], so_far(c, item))
        except Exception as exc:  # the response has begun: an error event, then the end
            if not isinstance(exc, APIError):
                logger.exception("stream %s failed", rid)
                exc = unavailable(f"generation failed: {type(exc).__name__}", "engine_error")
            info = {"message": exc.message, "type": exc.type, "param": exc.param}
            yield f"data: {json.dumps({'error': {**info, 'code': exc.code}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            await _stop(tasks, choices)
        if include_usage:
            usage = self._usage(choices, list(lasts.values()))
            yield chunk([], {"usage": usage.model_dump()})
        yield "data: [DONE]\n\n"


MAX_CHOICES = 64  # prompts x n per request: each is a sequence of its own


@dataclass
class _Choice:
    """One choice of a response: a prompt's sequence (its n-th sample when n > 1)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str
    prompt_index: int
    score_only: bool = False  # max_tokens 0: the prompt alone is returned (and scored)
    gen: Any = None  # the engine's output stream, once started
    first: RequestOutput | None = None
    started: bool = False  # ``first`` was awaited (a stream awaits the first choice's only)

    def finish_reason(self, last: RequestOutput | None) -> str:
        """``last``'s reason; "length" without one, or when only the prompt is returned."""
        return last.finish_reason if last is not None and not self.score_only else "length"


async def _stop(tasks: list[asyncio.Task], choices: list[_Choice]) -> None:
    """Cancel ``tasks`` and wait for them, then close every choice's stream: closing a
    stream aborts its sequence in the engine (closing one that never started is a no-op)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(
        *(c.gen.aclose() for c in choices if c.gen is not None), return_exceptions=True
    )


def _is_batch(prompt) -> bool:
    """A list of prompts (texts or token lists), not one token-list prompt."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
