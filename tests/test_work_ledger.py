"""The control plane's ledger of untrained chunks: a lost rank's go back once, with their tickets."""

from __future__ import annotations

import pytest

from lightning_prague.core.plane.work import MAX_HELD, WorkLedger

KEY = "epoch/0/cursor"


def test_a_lost_rank_gives_back_what_it_holds_untrained_with_its_tickets_and_nothing_it_trained():
    ledger = WorkLedger()
    assert ledger.set_aside(KEY, [0, 1, 2], [0, 1, 2], lost=[]) == []
    ledger.claimed(1, KEY, 5, 3)
    ledger.claimed(1, KEY, 7, 4)
    ledger.done(1, KEY, [1, 5])  # its set-aside chunk and one claimed chunk are trained
    assert ledger.lose(1) == {KEY: [(7, 4)]}
    assert ledger.lose(1) == {}  # given back once
    # rank 2 never claimed: its set-aside chunk goes back with its set-aside ticket (no hole)
    assert ledger.lose(2) == {KEY: [(2, 0)]}


def test_set_aside_chunks_of_a_rank_lost_before_any_claim_are_orphans_and_early_done_is_kept():
    ledger = WorkLedger()
    ledger.done(0, KEY, [0])  # rank 0 trained its set-aside chunk before anyone's first claim
    orphans = ledger.set_aside(KEY, [0, 1, 2], [0, 1, 2], lost=[1])
    assert orphans == [(1, -1)]  # the second of three set-aside tickets: claim value 1 + 1 - 3
    assert ledger.lose(0) == {}
    assert ledger.set_aside(KEY, [0, 1, 2], [0, 1, 2], lost=[2]) == []  # registered once
    ledger.forget(KEY)
    assert ledger.lose(2) == {}


def test_a_resumed_epochs_member_without_a_chunk_holds_none_and_holding_is_bounded():
    ledger = WorkLedger()
    ledger.set_aside(KEY, [0, 1], [9, -1], lost=[])
    assert ledger.lose(1) == {} and ledger.lose(0) == {KEY: [(9, -1)]}
    for chunk in range(MAX_HELD):
        ledger.claimed(3, KEY, chunk, None)
    with pytest.raises(ValueError, match="more than"):
        ledger.claimed(3, KEY, MAX_HELD, None)


def test_a_set_aside_chunk_a_lost_rank_held_before_anyone_claimed_goes_back_once_with_its_value():
    """A rank reported its set-aside chunk (a stream's shard, with its position) before the epoch's first
    claim registered the set-aside chunks, and was lost: the chunk goes back with what it reported, and
    the registration does not give it back a second time (from the start)."""
    ledger = WorkLedger()
    ledger.claimed(2, KEY, 2, 4)  # rank 2 holds its set-aside shard 2, trained up to position 4
    assert ledger.lose(2) == {KEY: [(2, 4)]}
    assert ledger.set_aside(KEY, [0, 1, 2], [0, 1, 2], lost=[2]) == []


def test_a_set_aside_chunk_held_and_trained_before_anyone_claimed_is_not_held_again_at_the_registration():
    """A rank holds its set-aside chunk with a ticket claimed apart from it (at the start of training) and
    trains it before any claim on the queue registered the set-aside chunks (each rank claims only after
    its first step): the registration must not hold it again, or a loss of that rank would give a trained
    chunk back (found: a kill after a rank's 5th batch had its first batch trained a second time)."""
    ledger = WorkLedger()
    ledger.claimed(1, KEY, 1, -2)  # its set-aside chunk, with the ticket it claimed at the start of training
    ledger.done(1, KEY, [1])
    assert ledger.set_aside(KEY, [0, 1, 2], [0, 1, 2], lost=[]) == []
    ledger.claimed(1, KEY, 6, 4)
    assert ledger.lose(1) == {KEY: [(6, 4)]}  # what it holds untrained, not the chunk it trained
    assert ledger.lose(0) == {KEY: [(0, -2)]}
