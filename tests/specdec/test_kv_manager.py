"""The slot table alone (no torch): dense slots, and the copies frees and forks need."""

import pytest

from specdec.kv_manager import SlotCopy, SlotTable


def test_slots_stay_dense_and_copies_carry_live_tokens_only():
    table = SlotTable(3)
    for sid, n in (("a", 5), ("b", 2), ("c", 9)):
        table.add(sid)
        table.set_length(sid, n)
    assert table.num_free == 0 and table.cached_tokens == 16
    with pytest.raises(RuntimeError, match="3 KV slots"):
        table.add("d")
    assert table.free("a") == SlotCopy(src=2, dst=0, length=9)  # c moves into a's hole
    assert table.slot("c") == 0 and table.length("c") == 9
    assert table.free("b") is None  # the last slot: nothing moves
    assert table.fork("c", "c2") == SlotCopy(src=0, dst=1, length=9)
    table.rollback("c2", 4)
    assert (table.length("c"), table.length("c2")) == (9, 4)
    table.rename("c2", "x")
    assert table.seq_ids == ["c", "x"] and "c2" not in table


def test_errors_leave_the_table_as_it_was():
    table = SlotTable(2)
    table.add("a")
    with pytest.raises(KeyError):
        table.add("a")
    with pytest.raises(KeyError):
        table.fork("missing", "b")
    assert table.seq_ids == ["a"]
    with pytest.raises(ValueError, match="cannot roll"):
        table.rollback("a", 1)
    with pytest.raises(KeyError):
        table.rename("a", "a")
