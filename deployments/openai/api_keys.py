"""API keys: whose a bearer key is, and how many of that client's requests may run at once.

Pure (no Ray, no HTTP framework), so that it is tested on its own; ``deployments/openai/server.py``
puts it in front of ``/v1/*``.

The store keeps SHA-256 digests, never the keys. A presented key is hashed and compared
with *every* stored digest by ``hmac.compare_digest``, without stopping at a match: digests
have one length, so neither which key matched nor how much of a key a guess shares changes
the time taken (only the number of keys does, which is no secret).

Keys come from the config (``api_key``, ``api_keys``, ``api_keys_file``) and, for each of
those left unset, from the replica's environment (``SPECSERVE_API_KEY``,
``SPECSERVE_API_KEYS``, ``SPECSERVE_API_KEYS_FILE``). The list format of the variable and
the file is ``name:key[:max_concurrent_requests]`` entries separated by commas, spaces or
newlines; ``#`` starts a comment. A key is an RFC 6750 bearer token, so it never contains
``:``, ``,``, ``#`` or whitespace and the format needs no quoting.

The concurrency limit is per replica: each replica counts the requests it is serving.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from deployments.config import DEFAULT_KEY_NAME, ApiKey, AppConfig, check_unique_keys

ENV_KEY = "SPECSERVE_API_KEY"
ENV_KEYS = "SPECSERVE_API_KEYS"
ENV_KEYS_FILE = "SPECSERVE_API_KEYS_FILE"

_LIMIT = re.compile(r"[0-9]+")


def _reasons(exc: ValidationError) -> str:
    """A validation error's reasons without its input (which may be a key)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
        for e in exc.errors(include_input=False, include_url=False)
    )


def parse_key_list(text: str, source: str) -> list[ApiKey]:
    """The ``name:key[:max_concurrent_requests]`` entries of ``text``. Errors name the
    source, the line and the reason, never the entry (it holds a key)."""
    keys = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for entry in line.split("#", 1)[0].replace(",", " ").split():
            where = f"{source}, line {lineno}"
            parts = entry.split(":")
            if len(parts) not in (2, 3):
                raise ValueError(
                    f"{where}: an entry is name:key[:max_concurrent_requests], "
                    f"this one has {len(parts)} ':'-separated fields"
                )
            name, key, *limit = parts
            if limit and not _LIMIT.fullmatch(limit[0]):
                raise ValueError(
                    f"{where}: max_concurrent_requests of {name!r} is not a whole number"
                )
            try:
                keys.append(
                    ApiKey(
                        name=name,
                        key=key,
                        max_concurrent_requests=int(limit[0]) if limit else None,
                    )
                )
            except ValidationError as exc:
                raise ValueError(f"{where}: {_reasons(exc)}") from None
    return keys


def collect_keys(config: AppConfig, environ: Mapping[str, str]) -> list[ApiKey]:
    """Every key a replica accepts: the config's, and the environment's for each source the
    config leaves unset. A list or file that is named but holds no key is refused rather
    than read as "no authentication"; so are duplicate names and keys."""
    keys: list[ApiKey] = []
    if config.api_key is not None:
        keys.append(ApiKey(name=DEFAULT_KEY_NAME, key=config.api_key))
    elif environ.get(ENV_KEY):
        try:
            keys.append(ApiKey(name=DEFAULT_KEY_NAME, key=environ[ENV_KEY]))
        except ValidationError as exc:
            raise ValueError(f"{ENV_KEY}: {_reasons(exc)}") from None
    if config.api_keys is not None:
        keys += config.api_keys
    elif environ.get(ENV_KEYS, "").strip():
        listed = parse_key_list(environ[ENV_KEYS], ENV_KEYS)
        if not listed:
            raise ValueError(f"{ENV_KEYS} is set but holds no name:key entry")
        keys += listed
    path = config.api_keys_file or environ.get(ENV_KEYS_FILE)
    if path:
        listed = parse_key_list(Path(path).read_text(), path)
        if not listed:
            raise ValueError(f"the API keys file {path} holds no name:key entry")
        keys += listed
    check_unique_keys(keys)
    return keys


def bearer_token(authorization: bytes | str | None) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` header; b"" when there is none."""
    if authorization is None:
        return b""
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


@dataclass(frozen=True)
class Client:
    """Whose a key is, as logs and the limiter know it: a name and a limit, no key."""

    name: str
    max_concurrent_requests: int | None  # per replica; None: unlimited

    def __str__(self) -> str:
        limit = self.max_concurrent_requests
        return self.name + (f" (at most {limit} at once)" if limit is not None else "")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class KeyStore:
    """The accepted keys, as digests, and the client each belongs to."""

    def __init__(self, keys: Sequence[ApiKey], default_limit: int | None = None):
        check_unique_keys(list(keys))
        self._entries = tuple(
            (
                _digest(k.key.get_secret_value().encode()),
                Client(k.name, k.max_concurrent_requests or default_limit),
            )
            for k in keys
        )

    @classmethod
    def from_config(cls, config: AppConfig, environ: Mapping[str, str]) -> KeyStore:
        """The store of a replica: ``environ`` is its environment (``os.environ``)."""
        return cls(collect_keys(config, environ), config.max_concurrent_requests_per_key)

    @property
    def enabled(self) -> bool:
        """False when no key is configured: the API is then open to anyone."""
        return bool(self._entries)

    @property
    def clients(self) -> tuple[Client, ...]:
        return tuple(client for _, client in self._entries)

    def lookup(self, presented: bytes | str) -> Client | None:
        """The client whose key was presented, or None. Compares with every key: see the
        module's docstring."""
        if isinstance(presented, str):
            presented = presented.encode("utf-8", "surrogateescape")
        digest = _digest(presented)
        found = None
        for stored, client in self._entries:
            if hmac.compare_digest(digest, stored):
                found = client  # no break: every digest is compared, match or not
        return found

    def __repr__(self) -> str:
        return f"KeyStore({', '.join(map(str, self.clients)) or 'no keys'})"


class ConcurrencyLimitExceeded(Exception):
    """A client is at its limit of requests in flight; retry after ``retry_after_s``."""

    def __init__(self, client: Client, retry_after_s: int):
        super().__init__(
            f"API key {client.name!r} has {client.max_concurrent_requests} request(s) in "
            "flight, its limit: retry when one has finished"
        )
        self.client, self.retry_after_s = client, retry_after_s


class Lease:
    """One admitted request's place in its client's count. Release it once, when the
    response has ended (a stream: when its last event is sent or its client leaves);
    releasing again does nothing, so that one request never frees another's place."""

    __slots__ = ("_limiter", "_name", "_released")

    def __init__(self, limiter: ConcurrencyLimiter, name: str):
        self._limiter, self._name, self._released = limiter, name, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self._name)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ConcurrencyLimiter:
    """Requests in flight per client, refused past the client's limit.

    A lock guards the counts although one event loop serves a replica's requests: the
    counts must stay right whichever thread releases (cheap, uncontended)."""

    def __init__(self, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, client: Client) -> Lease:
        """A place for one request of ``client``, or :class:`ConcurrencyLimitExceeded`."""
        with self._lock:
            n = self._in_flight.get(client.name, 0)
            limit = client.max_concurrent_requests
            if limit is not None and n >= limit:
                raise ConcurrencyLimitExceeded(client, self.retry_after_s)
            self._in_flight[client.name] = n + 1
        return Lease(self, client.name)

    def in_flight(self, name: str) -> int:
        with self._lock:
            return self._in_flight.get(name, 0)

    def _release(self, name: str) -> None:
        with self._lock:
            n = self._in_flight[name] - 1
            if n:
                self._in_flight[name] = n
            else:
                del self._in_flight[name]
