"""``/v1/completions``: a text, a token list, or a batch of either (one choice per prompt,
as lm-eval sends), with echo of the prompt and its logprobs (scoring, ``max_tokens`` 0)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from deployments.frontend.engine_client import RequestOutput
from deployments.openai import logprobs as lp
from deployments.openai.choices import MAX_CHOICES, Choice
from deployments.openai.errors import bad_request
from deployments.openai.protocol import CompletionResponse
from deployments.openai.serving import OpenAIServing
from deployments.openai.streaming import ResponseStream


class CompletionStream(ResponseStream):
    """A streamed completion: echoed prompts first, then texts with their logprobs, whose
    offsets continue from the echo's."""

    object = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token_end = {c.index: len(c.echo) for c in self.choices}  # next text_offset
        self.unechoed: set[int] = set()  # echoes that wait for the prompt's logprobs

    def opening(self) -> Iterator[str]:
        """The echo goes first; with prompt logprobs it waits for the first output,
        which carries them."""
        for c in self.choices:
            if c.params.prompt_logprobs is not None:
                self.unechoed.add(c.index)
            elif c.echo:
                yield self.chunk([self.part(c, None, c.echo)], self.usage_so_far(c, None))

    def on_output(self, c: Choice, out: RequestOutput | None) -> Iterator[str]:
        if c.index in self.unechoed:
            self.unechoed.discard(c.index)
            lps = lp.prompt_completion_logprobs(self.serving.tokenizer, c.prompt_ids, out)
            self.token_end[c.index] = lps["_end"]
            yield self.chunk([{**self.part(c, None, c.echo), "logprobs": lp.public(lps)}])
        yield from super().on_output(c, out)

    def part(self, c: Choice, out: RequestOutput | None, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"index": c.index, "text": text, "logprobs": None}
        if c.params.logprobs is not None and out is not None:
            lps = lp.completion_logprobs(
                self.serving.tokenizer, out, lp.new_completion_logprobs(self.token_end[c.index])
            )
            self.token_end[c.index] = lps["_end"]
            part["logprobs"] = lp.public(lps)
        part["finish_reason"] = None
        return part

    def end_fields(self) -> dict[str, Any]:
        return {"text": "", "logprobs": None}


class OpenAIServingCompletion(OpenAIServing):
    operation = "text_completion"
    id_prefix = "cmpl-"
    response_cls = CompletionResponse
    stream_cls = CompletionStream

    def prompts(self, req) -> list[tuple[list[int], str]]:
        batch = req.prompt if _is_batch(req.prompt) else [req.prompt]
        if not batch:
            raise bad_request("prompt must not be empty", "invalid_value", "prompt")
        if len(batch) > MAX_CHOICES:
            raise bad_request(
                f"at most {MAX_CHOICES} prompts per request", "invalid_value", "prompt"
            )
        return [(self.encode_prompt(prompt), self._echo(req, prompt)) for prompt in batch]

    def _echo(self, req, prompt: str | list[int]) -> str:
        """The text ``prompt`` echoes ("" without echo)."""
        if not req.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is not None:
            return self.tokenizer.decode(prompt)
        raise bad_request(
            "echo needs a tokenizer to turn token ids into text", "invalid_value", "echo"
        )

    def logprobs_params(self, req) -> tuple[int | None, int | None]:
        # Completions ask with a count; echo with it scores the prompt too.
        return req.logprobs, (req.logprobs if req.echo else None)

    def score_only(self, req) -> bool:
        return req.max_tokens == 0

    def new_logprobs(self, c: Choice) -> dict[str, Any]:
        if c.params.prompt_logprobs is not None:
            return lp.prompt_completion_logprobs(self.tokenizer, c.prompt_ids, c.first)
        return lp.new_completion_logprobs(len(c.echo))

    def add_logprobs(self, acc: dict[str, Any], out: RequestOutput) -> None:
        lp.completion_logprobs(self.tokenizer, out, acc)

    def choice_content(self, c: Choice, text: str, logprobs: Any) -> dict[str, Any]:
        content: dict[str, Any] = {"text": text}
        if c.params.logprobs is not None:
            content["logprobs"] = lp.public(logprobs)
        return content


def _is_batch(prompt) -> bool:
    """A list of prompts (texts or token lists), not one token-list prompt."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
