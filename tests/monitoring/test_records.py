"""The monitor's records stay readable across a rolling update of either side
(monitoring/records.py): a record from an older sender lacks the fields added since and
reads their defaults; one from a newer sender carries fields the reader ignores."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from monitoring.records import (
    AlertCursor,
    AlertRecord,
    ReportReply,
    RequestRecord,
    RoundBatch,
    RoundRecord,
)

RECORDS = [
    RoundRecord("code", 4, 3, cache_hit=True),
    RoundBatch("m", "r", rounds=[RoundRecord("code", 4, 4)], running=3, dropped=2),
    RequestRecord("m", "r", "code", "chat", 0.05, 0.5, 10, error_type="timeout"),
    ReportReply([AlertRecord("code", 0.4)], AlertCursor("epoch", 3)),
]


def _wire(record) -> object:
    return pickle.loads(pickle.dumps(record))


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_an_older_sender_s_record_reads_the_defaults_of_newer_fields(record):
    plain_defaults = [
        f
        for f in dataclasses.fields(record)
        if f.default is not dataclasses.MISSING  # (a default_factory has no class attribute)
    ]
    for f in plain_defaults:
        old = pickle.loads(pickle.dumps(record))
        del old.__dict__[f.name]  # as pickled by a version before the field existed
        back = _wire(old)
        assert getattr(back, f.name) == f.default
        assert getattr(back, dataclasses.fields(record)[0].name) == getattr(
            record, dataclasses.fields(record)[0].name
        )


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_newer_sender_s_extra_field_is_ignored(record):
    new = pickle.loads(pickle.dumps(record))
    new.__dict__["added_in_a_later_version"] = 1
    back = _wire(new)
    assert back == record  # equality compares the declared fields only


def test_records_are_plain_dataclasses_without_slots():
    # Slots would make unpickling depend on the exact field list of both versions.
    for record in RECORDS:
        assert not hasattr(type(record), "__slots__")
        assert type(record).__dataclass_params__.frozen
