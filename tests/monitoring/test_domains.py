"""Domain resolution: the configured source, the global key, and bounded cardinality."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.config import MonitoringConfig
from monitoring.domains import DomainResolver


def resolver(**kw) -> DomainResolver:
    return DomainResolver(MonitoringConfig(**kw))


def test_each_source_reads_its_own_field():
    md, user, headers = {"domain": "code"}, "alice", {"x-specserve-domain": "chat"}
    assert resolver(domain_source="metadata").resolve(user, md, headers) == "code"
    assert resolver(domain_source="user").resolve(user, md, headers) == "alice"
    header = resolver(domain_source="header", domain_key="x-specserve-domain")
    assert header.resolve(user, md, headers) == "chat"
    assert resolver(domain_source="none").resolve(user, md, headers) == "default"


@pytest.mark.parametrize("md", [None, {}, {"other": "x"}, {"domain": ""}])
def test_requests_that_name_no_domain_get_the_global_key(md):
    assert resolver(default_domain="all").resolve(None, md) == "all"


def test_unknown_and_excess_domains_overflow():
    listed = resolver(domains=["code", "chat"])
    assert listed.resolve(metadata={"domain": "code"}) == "code"
    assert listed.resolve(metadata={"domain": "tenant-9"}) == "__overflow__"
    capped = resolver(max_domains=3)  # the global key counts as one
    names = [capped.resolve(metadata={"domain": f"d{i}"}) for i in range(5)]
    assert names == ["d0", "d1", "__overflow__", "__overflow__", "__overflow__"]
    assert capped.resolve(metadata={"domain": "d1"}) == "d1"  # known names stay


# Lists of up to 40 names (five times the cap) of up to 100 characters (past the 64 a name
# keeps). Generating them is what the too_slow health check times, and on a loaded 2-core
# machine it failed even at these sizes (8 inputs in 1.7 s): the check is off, the inputs
# are the same (derandomized), the test's own work is microseconds.
@settings(max_examples=200, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=100), max_size=40))
def test_whatever_clients_send_the_set_of_domains_stays_bounded(names):
    r = resolver(max_domains=8)
    got = {r.resolve(metadata={"domain": n}) for n in names}
    assert len(got - {"__overflow__"}) <= 8
    for name in got:
        assert len(name) <= 64 and name.isprintable() and " " not in name
