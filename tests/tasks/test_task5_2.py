"""Task 5.2: weight_versions and versions_in_flight, weight stashing in asynchronous PipeDream.

References written out here: PipeDream's closed forms on 1F1B's order (``schedule_tables``):
F(s, i) and B(s, i) use version max(0, i - (p - s - 1)) with an update after each
backward; p - s versions held on stage s once m >= 2p - 1; small hand-made tables
(update_every = 2, a stage whose backwards come late, several stages on one device, also with
update_every = 2 and their backwards and forwards interleaved); ValueError for update_every
zero or negative.
"""

from __future__ import annotations

import copy

import pytest

from schedule_tables import one_f_one_b_table

pytestmark = pytest.mark.task5_2

GRID = [(p, m) for p in range(1, 7) for m in range(1, 13)]


def module(impl):
    return impl("weight_stashing")


def test_versions_on_1f1b_order_follow_the_closed_form(impl):
    for p, m in GRID:
        table = one_f_one_b_table(p, m)
        versions = module(impl).weight_versions(table)
        assert isinstance(versions, dict) and len(versions) == 2 * p * m
        for s in range(p):
            for i in range(m):
                expected = max(0, i - (p - s - 1))
                assert versions[("F", s, i)] == versions[("B", s, i)] == expected, (
                    f"1F1B order, p={p}, m={m}: F({s}, {i}) and B({s}, {i}) should use version {expected} "
                    f"(the updates of the backwards before F({s}, {i}) in stage {s}'s list); got "
                    f"{versions[('F', s, i)]} and {versions[('B', s, i)]}")


def test_stashed_not_live(impl):
    table = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]]
    versions = module(impl).weight_versions(table)
    assert versions == {("F", 0, 0): 0, ("F", 0, 1): 0, ("B", 0, 0): 0, ("B", 0, 1): 0}, (
        "B(0, 1) runs after the update of B(0, 0), but with the version F(0, 1) stashed: 0")


def test_updating_every_two_backwards(impl):
    table = [[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1), ("F", 0, 2), ("B", 0, 2), ("F", 0, 3), ("B", 0, 3)]]
    versions = module(impl).weight_versions(table, update_every=2)
    assert [versions[("F", 0, i)] for i in range(4)] == [0, 0, 1, 1]


def test_updating_every_two_backwards_holds_fewer_versions_in_flight(impl):
    # 1F1B, p = 3, m = 5, an update after every second B.  Stage 0 (F0 F1 F2 B0 F3 B1 F4 B2
    # B3 B4): F0..F3 stash version 0; the update after B1 makes live 1, so F4 stashes 1;
    # at most {0, 1} at once (after B1: F2, F3 on 0, live 1; after B3: F4 on 1, live 2): 2.
    # Stage 1 (F0 F1 B0 F2 B1 F3 B2 F4 B3 B4): after B1, F2 on 0 and live 1; after B3, F4
    # on 1 and live 2: 2.  Stage 2 (F B pairs) never holds a stash past its B: 1.  With an
    # update after every B, stage 0 would hold 3 (after B1: F2 on 0, F3 on 1, live 2).
    found = module(impl).versions_in_flight(one_f_one_b_table(3, 5), update_every=2)
    assert found == [2, 2, 1], (
        "1F1B order, p=3, m=5, update_every=2: the live weights move after every second B only, "
        f"so the stages hold [2, 2, 1] versions at most; got {found}")


def test_several_stages_on_one_device_count_their_own_updates(impl):
    table = [[("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1)]]
    versions = module(impl).weight_versions(table)
    assert versions[("F", 1, 1)] == 1 and versions[("F", 0, 1)] == versions[("B", 0, 1)] == 0, (
        "stage 1's update after B(1, 0) moves stage 1's weights only")
    assert module(impl).versions_in_flight(table) == [2, 1]


def test_several_stages_on_one_device_each_count_their_own_backwards(impl):
    # Stages 0 and 1 on one device, two micro-batches in flight, an update after every
    # second B of a stage.  B(1, 0) and B(0, 0) come before F(0, 2): each is its stage's
    # first B, so no update yet and F(0, 2) runs on 0 (counting B's per device would
    # update stage 0 at B(0, 0)).  After B(1, 1) and B(0, 1) each stage updates once:
    # F(0, 3) and F(1, 3) run on 1 (one live version per device would give F(0, 3) 2).
    table = [[("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("B", 1, 0), ("B", 0, 0),
              ("F", 0, 2), ("F", 1, 2), ("B", 1, 1), ("B", 0, 1),
              ("F", 0, 3), ("F", 1, 3), ("B", 1, 2), ("B", 0, 2), ("B", 1, 3), ("B", 0, 3)]]
    before = copy.deepcopy(table)
    versions = module(impl).weight_versions(table, update_every=2)
    expected = {(kind, s, i): int(i == 3) for kind in "FB" for s in range(2) for i in range(4)}
    assert versions == expected, (
        "each stage counts its own backwards and moves its own live weights (several stages on one device)\n"
        f"update_every=2 on the table {table}\ngave {versions}\nexpected {expected}")
    found = module(impl).versions_in_flight(table, update_every=2)
    assert found == [2, 2], (
        "each stage counts its own backwards and moves its own live weights (several stages on one device)\n"
        f"versions_in_flight(table, update_every=2) is {found}: after B(s, 1) and before F(s, 3), stage s "
        "holds the version 0 of F(s, 2) and its live weights, version 1: [2, 2]")
    assert table == before, "the table must not be changed"


@pytest.mark.parametrize("update_every", [0, -1, -2])
def test_update_every_below_1_is_refused(impl, update_every):
    table = one_f_one_b_table(2, 4)
    for function in ("weight_versions", "versions_in_flight"):
        with pytest.raises(ValueError):
            found = getattr(module(impl), function)(table, update_every)
            pytest.fail(f"weight_versions raises ValueError if update_every < 1 (zero or negative)\n"
                        f"{function}(1F1B(2, 4), update_every={update_every}) returned {found}")


def test_p_minus_s_versions_held_in_the_steady_state(impl):
    for p, m in GRID:
        found = module(impl).versions_in_flight(one_f_one_b_table(p, m))
        assert isinstance(found, list) and len(found) == p
        if m >= 2 * p - 1:
            assert found == [p - s for s in range(p)], (
                f"1F1B order, p={p}, m={m}: stage s keeps p - s versions in the steady state "
                f"(live weights included); got {found}")
        assert all(1 <= f <= p - s for s, f in enumerate(found)), (p, m, found)


def test_few_microbatches_hold_fewer_versions(impl):
    # p = m = 4: stage 0's four forwards all ran on version 0, so it holds that one and its
    # live weights; stage 1 (F0 F1 F2 B0 F3 B1 ...) holds versions 0, 1 and live 2 after B1.
    assert module(impl).versions_in_flight(one_f_one_b_table(4, 4)) == [2, 3, 2, 1]


def test_input_unchanged_and_errors(impl):
    table = one_f_one_b_table(3, 5)
    before = copy.deepcopy(table)
    module(impl).weight_versions(table)
    module(impl).versions_in_flight(table)
    assert table == before, "the table must not be changed"
    with pytest.raises(ValueError):
        module(impl).weight_versions(table, update_every=0)
    with pytest.raises(ValueError):
        module(impl).weight_versions([[("B", 0, 0), ("F", 0, 0)]])
