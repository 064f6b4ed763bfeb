"""Errors in OpenAI's shape, raised anywhere in the HTTP layer and turned into a status by
the app's handler (:mod:`deployments.openai.server`), or into an error event by a stream
that has already begun (:mod:`deployments.openai.streaming`)."""

from __future__ import annotations

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
