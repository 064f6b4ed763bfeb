"""API keys without Ray or HTTP: the config's validation, the key store, the limiter."""

import logging
import pickle

import pytest
from pydantic import ValidationError

from deployments.config import ApiKey, AppConfig
from deployments.openai.api_keys import (
    ConcurrencyLimiter,
    ConcurrencyLimitExceeded,
    KeyStore,
    bearer_token,
    collect_keys,
    parse_key_list,
)
from tests.conftest import ROOT

ENGINE = {"target": {"model": "models/demo-target"}}
ALICE, BOB = "alice-3f9c2b7e0d", "bob-8a1e44c0c2"


def app(**kw) -> AppConfig:
    return AppConfig.model_validate({"engine": ENGINE, **kw})


def store(keys, default_limit=None) -> KeyStore:
    return KeyStore([ApiKey.model_validate(k) for k in keys], default_limit)


def test_each_key_finds_its_client_and_nothing_else_does():
    s = store(
        [{"name": "alice", "key": ALICE, "max_concurrent_requests": 2}, {"name": "bob", "key": BOB}]
    )
    assert s.lookup(ALICE).name == "alice" and s.lookup(ALICE).max_concurrent_requests == 2
    assert s.lookup(BOB.encode()).name == "bob" and s.lookup(BOB).max_concurrent_requests is None
    for wrong in ("", ALICE[:-1], ALICE + "x", ALICE.upper(), f"{ALICE} ", BOB + ALICE, "\udcff"):
        assert s.lookup(wrong) is None, wrong
    assert s.enabled and not KeyStore([]).enabled


def test_the_default_limit_applies_to_keys_that_set_none():
    s = store(
        [
            {"name": "alice", "key": ALICE, "max_concurrent_requests": 5},
            {"name": "bob", "key": BOB},
        ],
        3,
    )
    assert [c.max_concurrent_requests for c in s.clients] == [5, 3]


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (b"Bearer abc", b"abc"),
        (b"bearer  abc ", b"abc"),
        ("BEARER abc", b"abc"),
        (b"Basic abc", b""),
        (b"Bearer", b""),
        (b"abc", b""),
        (None, b""),
    ],
)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_over_the_limit_is_refused_until_a_request_ends():
    s = store(
        [{"name": "alice", "key": ALICE, "max_concurrent_requests": 2}, {"name": "bob", "key": BOB}]
    )
    alice, bob = s.lookup(ALICE), s.lookup(BOB)
    limiter = ConcurrencyLimiter(retry_after_s=7)
    first, second = limiter.acquire(alice), limiter.acquire(alice)
    with pytest.raises(ConcurrencyLimitExceeded) as refused:
        limiter.acquire(alice)
    assert refused.value.retry_after_s == 7 and refused.value.client == alice
    assert ALICE not in str(refused.value) and "alice" in str(refused.value)
    bobs = [limiter.acquire(bob) for _ in range(50)]  # no limit: never refused
    assert limiter.in_flight("alice") == 2 and limiter.in_flight("bob") == 50
    first.release()
    third = limiter.acquire(alice)  # the place first held
    with pytest.raises(ConcurrencyLimitExceeded):
        limiter.acquire(alice)
    first.release()  # a second release of the same lease frees nothing
    with pytest.raises(ConcurrencyLimitExceeded):
        limiter.acquire(alice)
    for lease in (second, third, *bobs):
        lease.release()
    assert limiter.in_flight("alice") == limiter.in_flight("bob") == 0
    with limiter.acquire(alice), limiter.acquire(alice):  # leases release on leaving a block
        assert limiter.in_flight("alice") == 2
    assert limiter.in_flight("alice") == 0


def test_a_lease_is_released_when_the_block_raises():
    alice = store([{"name": "alice", "key": ALICE, "max_concurrent_requests": 1}]).lookup(ALICE)
    limiter = ConcurrencyLimiter()
    with pytest.raises(RuntimeError), limiter.acquire(alice):
        raise RuntimeError("the request failed")
    limiter.acquire(alice).release()


@pytest.mark.parametrize(
    ("keys", "reason"),
    [
        ([{"name": "a", "key": ""}], "bearer token"),
        ([{"name": "a", "key": "has space"}], "bearer token"),
        ([{"name": "a", "key": "colon:inside"}], "bearer token"),
        ([{"name": "a", "key": "ключ"}], "bearer token"),
        ([{"name": "", "key": ALICE}], "pattern"),
        ([{"name": "a b", "key": ALICE}], "pattern"),
        ([{"name": "a", "key": ALICE, "max_concurrent_requests": 0}], "greater than or equal to 1"),
        ([{"name": "a", "key": ALICE}, {"name": "a", "key": BOB}], "'a' is used twice"),
        (
            [{"name": "a", "key": ALICE}, {"name": "b", "key": ALICE}],
            "'a' and 'b' are the same key",
        ),
        ([{"name": "default", "key": BOB}], "'default' is used twice"),  # api_key's name
        ([{"name": "a", "key": "sekret-value"}], "'default' and 'a' are the same key"),
    ],
)
def test_config_refuses_bad_keys_without_quoting_them(keys, reason):
    with pytest.raises(ValidationError) as exc:
        app(api_key="sekret-value", api_keys=keys)
    message = str(exc.value)
    assert reason in message
    for k in keys:
        if k["key"]:
            assert k["key"] not in message
    assert "sekret-value" not in message


def test_config_errors_never_quote_the_input():
    """A mistyped field name holding keys, or a bad api_key, is refused without echoing it."""
    with pytest.raises(ValidationError) as exc:
        app(api_kyes=[{"name": "a", "key": ALICE}], api_key="bad key")
    assert "api_kyes" in str(exc.value) and "api_key" in str(exc.value)
    assert ALICE not in str(exc.value) and "bad key" not in str(exc.value)


def test_keys_never_appear_in_repr_str_dumps_or_logs(caplog):
    cfg = app(api_key="sekret-value", api_keys=[{"name": "alice", "key": ALICE}])
    env = {"SPECSERVE_API_KEYS": f"alice:{ALICE} bob:{BOB}:1"}
    s = KeyStore.from_config(app(api_key="sekret-value"), env)
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("config %s %r, keys %s %r", cfg, cfg, s, s)
    shown = [repr(cfg), str(cfg), repr(s), str(s), cfg.model_dump_json(), caplog.text]
    shown += [repr(cfg.model_dump()), str(s.clients)]
    for text in shown:
        for key in ("sekret-value", ALICE, BOB):
            assert key not in text
    assert "alice" in repr(s) and "bob (at most 1 at once)" in repr(s)
    assert all(k.encode() not in pickle.dumps(s) for k in ("sekret-value", ALICE, BOB))


def test_config_survives_the_python_dump_that_binds_it_to_the_deployment():
    cfg = app(api_key="sekret-value", api_keys=[{"name": "alice", "key": ALICE}])
    again = AppConfig.model_validate(pickle.loads(pickle.dumps(cfg.model_dump())))
    s = KeyStore.from_config(again, {})
    assert s.lookup("sekret-value").name == "default" and s.lookup(ALICE).name == "alice"


def test_list_format():
    text = f"""
    # name:key[:max_concurrent_requests]
    alice:{ALICE}:2   # a comment
    bob:{BOB}, carol:c-key:1
    """
    keys = parse_key_list(text, "keys.txt")
    assert [(k.name, k.key.get_secret_value(), k.max_concurrent_requests) for k in keys] == [
        ("alice", ALICE, 2),
        ("bob", BOB, None),
        ("carol", "c-key", 1),
    ]


def test_the_keys_file_example_in_security_md_parses():
    text = (ROOT / "SECURITY.md").read_text()
    example = text[text.index("# /etc/specserve/api_keys") :].split("```", 1)[0]
    keys = parse_key_list(example, "SECURITY.md")
    assert [(k.name, k.max_concurrent_requests) for k in keys] == [
        ("search-team", 8),
        ("batch-jobs", 2),
        ("notebook", None),
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (f"alice{ALICE}", "line 2: an entry is name:key[:max_concurrent_requests]"),
        (f"alice:{ALICE}:2:3", "4 ':'-separated fields"),
        (f"alice:{ALICE}:two", "line 2: max_concurrent_requests of 'alice' is not"),
        (f"alice:{ALICE}:0", "greater than or equal to 1"),
        (f"alice:{ALICE}:-1", "not a whole number"),
        (f"al/ice:{ALICE}", "name: String should match pattern"),
        ("alice:", "an API key must be a non-empty bearer token"),
    ],
)
def test_list_format_errors_name_the_line_not_the_key(text, reason):
    with pytest.raises(ValueError) as exc:
        parse_key_list(f"ok:ok-key\n{text}\n", "keys.txt")
    assert "keys.txt" in str(exc.value) and reason in str(exc.value)
    assert ALICE not in str(exc.value)


def test_sources_and_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("carol:c-key:1\n")
    env = {
        "SPECSERVE_API_KEY": "env-single",
        "SPECSERVE_API_KEYS": f"alice:{ALICE}:2",
        "SPECSERVE_API_KEYS_FILE": str(keys_file),
    }

    def names(cfg, environ):
        return [(k.name, k.key.get_secret_value()) for k in collect_keys(cfg, environ)]

    assert names(app(), {}) == []
    assert names(app(), env) == [("default", "env-single"), ("alice", ALICE), ("carol", "c-key")]
    other = tmp_path / "other"
    other.write_text("dave:d-key")
    configured = app(
        api_key="cfg-single", api_keys=[{"name": "bob", "key": BOB}], api_keys_file=str(other)
    )
    # Each source the config sets wins over its environment variable.
    assert names(configured, env) == [("default", "cfg-single"), ("bob", BOB), ("dave", "d-key")]
    assert names(app(api_keys=[]), env) == [("default", "env-single"), ("carol", "c-key")]
    empty = {"SPECSERVE_API_KEY": "", "SPECSERVE_API_KEYS": " ", "SPECSERVE_API_KEYS_FILE": ""}
    assert names(app(), empty) == []  # empty variables are unset
    s = KeyStore.from_config(app(max_concurrent_requests_per_key=4), env)
    assert [(c.name, c.max_concurrent_requests) for c in s.clients] == [
        ("default", 4),
        ("alice", 2),
        ("carol", 1),
    ]


@pytest.mark.parametrize(
    ("env", "file_text", "reason"),
    [
        ({"SPECSERVE_API_KEYS": "# nothing"}, None, "SPECSERVE_API_KEYS is set but holds no"),
        ({}, "# no keys yet\n", "holds no name:key entry"),
        ({"SPECSERVE_API_KEY": "bad key"}, None, "SPECSERVE_API_KEY: key: Value error"),
        ({"SPECSERVE_API_KEYS": f"a:{ALICE}"}, f"a:{BOB}", "'a' is used twice"),
        ({"SPECSERVE_API_KEYS": f"a:{ALICE}"}, f"b:{ALICE}", "'a' and 'b' are the same key"),
    ],
)
def test_source_errors_refuse_to_start(tmp_path, env, file_text, reason):
    """A named source without keys is refused, never read as 'no authentication'."""
    cfg = app()
    if file_text is not None:
        (tmp_path / "keys").write_text(file_text)
        cfg = app(api_keys_file=str(tmp_path / "keys"))
    with pytest.raises(ValueError) as exc:
        collect_keys(cfg, env)
    assert reason in str(exc.value)
    assert (
        ALICE not in str(exc.value)
        and BOB not in str(exc.value)
        and "bad key" not in str(exc.value)
    )


def test_a_missing_keys_file_refuses_to_start(tmp_path):
    with pytest.raises(FileNotFoundError):
        collect_keys(app(api_keys_file=str(tmp_path / "absent")), {})
