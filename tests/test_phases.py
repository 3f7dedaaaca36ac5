"""The synchronization-point state machine on its own: phases, the meetings owed, boundary validation."""

from __future__ import annotations

from lightning_prague.core.exchange.phases import Phase, SyncController, Validation


def test_a_fit_alternates_aligned_stretches_and_asynchronous_phases():
    controller = SyncController()
    assert controller.aligned and not controller.must_meet  # a synchronization point before any batch: a no-op
    controller.batch_starts()
    assert controller.phase is Phase.ASYNCHRONOUS and not controller.aligned and controller.must_meet
    controller.met()
    assert controller.phase is Phase.ALIGNED and controller.aligned and not controller.must_meet
    assert controller.meetings == 1


def test_a_meeting_inside_an_epoch_owes_the_epoch_end_even_without_another_batch():
    controller = SyncController()
    controller.batch_starts()
    controller.met(inside_epoch=True)
    # collectives are safe (everyone just met), but the others train on: the epoch's end must meet them
    assert controller.aligned and controller.must_meet and controller.phase is Phase.MET_INSIDE_EPOCH
    controller.met()  # the epoch end
    assert not controller.must_meet
    controller.batch_starts()
    controller.met(inside_epoch=True)
    controller.batch_starts()  # it trains on after the boundary: an asynchronous phase again
    assert controller.phase is Phase.ASYNCHRONOUS


def test_validation_asked_by_a_boundary_runs_right_after_its_meeting_without_another():
    controller = SyncController()
    assert controller.take_validation(loop_would_validate=True) is None  # no boundary: the loop decides
    controller.batch_starts()
    controller.met(inside_epoch=True, validate=True)
    assert controller.validation is Validation.DUE
    assert controller.take_validation(loop_would_validate=True) is True
    assert controller.validation_starts() is False  # the ranks met just before: no meeting of its own
    assert controller.validation_starts() is True  # a later validation (the epoch's) meets as usual


def test_a_boundary_validation_the_epoch_setting_forbids_is_skipped_and_forgotten():
    controller = SyncController()
    controller.batch_starts()
    controller.met(inside_epoch=True, validate=True)
    assert controller.take_validation(loop_would_validate=False) is False
    assert controller.validation is Validation.NONE and controller.validation_starts() is True


def test_teardown_resets_whatever_state_an_error_left():
    controller = SyncController()
    controller.batch_starts()
    controller.sigterm = True
    controller.met(inside_epoch=True, validate=True)
    controller.batch_starts()
    controller.reset()
    assert controller.phase is Phase.ALIGNED and controller.validation is Validation.NONE and not controller.sigterm
    assert "aligned" in repr(controller)
