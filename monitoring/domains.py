"""Which traffic domain a request belongs to: the key acceptance is tracked and alerted on.

A domain is a tenant, an application or a kind of traffic. Its name comes from one
configurable source (the OpenAI ``user`` field, a ``metadata`` key, or an HTTP header);
a request that carries none belongs to the global key (``default_domain``). Because the
name becomes a metric label and a detector slot, what clients send must not be able to
grow either without bound: a name that is not a short token (``[A-Za-z0-9_.:-]``, at most
64 characters), that is not in the configured list (when there is one), or that arrives
after ``max_domains`` names are in use, is pooled into ``overflow_domain``. Pure: no Ray,
no HTTP framework; the serving layer passes plain values in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import BaseModel

_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


class DomainResolver:
    """Maps a request's ``user`` / ``metadata`` / headers to a bounded set of domains."""

    def __init__(self, config: BaseModel):
        # config: monitoring.config.MonitoringConfig (domain_source, domain_key,
        # default_domain, domains, max_domains, overflow_domain)
        self.source = config.domain_source
        self.key = config.domain_key
        self.default = config.default_domain
        self.overflow = config.overflow_domain
        self.allowed = frozenset(config.domains) if config.domains is not None else None
        self.max_domains = config.max_domains
        self._seen: set[str] = {self.default}

    def raw(
        self,
        user: str | None = None,
        metadata: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str | None:
        """The name the request carries at the configured source (None: none)."""
        if self.source == "user":
            return user
        if self.source == "metadata":
            return (metadata or {}).get(self.key)
        if self.source == "header":
            return None if headers is None else headers.get(self.key)
        return None

    def resolve(
        self,
        user: str | None = None,
        metadata: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        return self.bound(self.raw(user, metadata, headers))

    def bound(self, name: str | None) -> str:
        """``name`` if it may be a domain of its own, else the global or overflow key."""
        if not name:
            return self.default
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            return self.overflow
        if self.allowed is not None:
            return name if name in self.allowed or name == self.default else self.overflow
        if name in self._seen:
            return name
        if len(self._seen) >= self.max_domains:
            return self.overflow
        self._seen.add(name)
        return name
