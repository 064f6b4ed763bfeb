"""``/v1/chat/completions``: messages rendered by the model's chat template, replies that
end at the template's end of turn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from deployments.frontend.engine_client import RequestOutput
from deployments.openai import logprobs as lp
from deployments.openai.choices import Choice
from deployments.openai.errors import bad_request, check_text
from deployments.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from deployments.openai.serving import OpenAIServing
from deployments.openai.streaming import ResponseStream


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


class ChatStream(ResponseStream):
    """A streamed chat reply: the assistant's role first, then content deltas."""

    object = "chat.completion.chunk"

    def opening(self) -> Iterator[str]:
        role = {"role": "assistant", "content": ""}
        for c in self.choices:
            part = {"index": c.index, "delta": role, "finish_reason": None}
            yield self.chunk([part], self.usage_so_far(c, None))

    def part(self, c: Choice, out: RequestOutput | None, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"index": c.index, "delta": {"content": text}}
        if c.params.logprobs is not None and out is not None:
            part["logprobs"] = {"content": lp.chat_logprobs(self.serving.tokenizer, out)}
        part["finish_reason"] = None
        return part

    def end_fields(self) -> dict[str, Any]:
        return {"delta": {}}


class OpenAIServingChat(OpenAIServing):
    operation = "chat"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"
    response_cls = ChatCompletionResponse
    stream_cls = ChatStream

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.end_of_turn_ids = end_of_turn_ids(self.tokenizer)

    def prompts(self, req: ChatCompletionRequest) -> list[tuple[list[int], str]]:
        return [(self.encode_chat(req), "")]

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

    def max_tokens_field(self, req) -> tuple[str, int | None]:
        if req.max_completion_tokens is not None:
            return "max_completion_tokens", req.max_completion_tokens
        return "max_tokens", req.max_tokens

    def implicit_stop_token_ids(self, req) -> tuple[int, ...]:
        # The template's end of turn ends a chat reply.
        return () if req.ignore_eos else self.end_of_turn_ids

    def logprobs_params(self, req) -> tuple[int | None, int | None]:
        # Chat asks with a flag and a count (completions with a count alone).
        return ((req.top_logprobs or 0) if req.logprobs else None), None

    def new_logprobs(self, c: Choice) -> list[dict[str, Any]]:
        return []

    def add_logprobs(self, acc: list[dict[str, Any]], out: RequestOutput) -> None:
        acc.extend(lp.chat_logprobs(self.tokenizer, out))

    def choice_content(self, c: Choice, text: str, logprobs: Any) -> dict[str, Any]:
        content: dict[str, Any] = {"message": {"content": text}}
        if c.params.logprobs is not None:
            content["logprobs"] = {"content": logprobs}
        return content
