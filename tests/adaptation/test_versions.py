"""The version history: numbers only grow, a rollback is a new version."""

import pytest

from adaptation.versions import VersionHistory


def test_trained_versions_and_rollbacks_number_upwards():
    h = VersionHistory(clock=lambda: 1.0)
    assert h.current.version == 0 and h.current.origin == "deployed"
    with pytest.raises(ValueError, match="nothing to roll back"):
        h.rollback_target(None)
    v1 = h.add_trained("prose", "gained", 0.1, 0.7)
    v2 = h.add_trained("code", "gained", 0.5, 0.6)
    assert (v1.version, v2.version) == (1, 2) and h.current is v2
    back = h.add_rollback(h.rollback_target(None), "live alpha fell")
    assert back.version == 3 and back.weights_of == 1 and back.origin == "rolled_back"
    assert back.domain == "code"  # the domain of the version it undid
    to_zero = h.add_rollback(h.rollback_target(0), "operator")
    assert to_zero.version == 4 and to_zero.weights_of == 0
    with pytest.raises(ValueError, match="already serves"):
        h.rollback_target(0)
    with pytest.raises(ValueError, match="not in the history"):
        h.rollback_target(99)


def test_the_history_is_bounded_and_keeps_version_0():
    h = VersionHistory(max_kept=3)
    for i in range(10):
        h.add_trained("d", str(i), None, None)
    assert [v.version for v in h.versions] == [0, 8, 9, 10]
    assert h.weights_in_use() == {0, 8, 9, 10}
    h.add_rollback(h.rollback_target(9), "x")
    assert h.weights_in_use() == {0, 9, 10}  # version 8 left the history, 11 serves 9's
    assert h.weights_in_use(recent=2) == {9, 10}  # 10 and 11 (9's weights)


def test_a_restarted_history_serves_the_deployed_draft_above_what_replicas_serve():
    h = VersionHistory()
    v = h.restart_after(7)
    assert (v.version, v.weights_of, v.origin) == (8, 0, "rolled_back")
    assert h.current is v and h.add_trained("d", "r", None, None).version == 9
    assert h.rollback_target(None).version == 8  # (its weights: the deployed draft's)
