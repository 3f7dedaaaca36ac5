"""The launcher that lets survivors go on, and the automatic resume of a restarted fit."""

from __future__ import annotations

import logging

import lightning as L

from lightning_prague import PartialAllReduceStrategy
from lightning_prague.strategies.launcher import SurvivingScriptLauncher, resume_from_last


def test_the_script_launcher_is_replaced_by_one_that_does_not_kill_every_rank():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PartialAllReduceStrategy(group_size=2), logger=False)
    assert isinstance(trainer.strategy.launcher, SurvivingScriptLauncher)
    spawned = L.Trainer(
        accelerator="cpu", devices=2, strategy=PartialAllReduceStrategy(group_size=2, start_method="spawn")
    )
    assert not isinstance(spawned.strategy.launcher, SurvivingScriptLauncher)


def test_a_restarted_fit_resumes_from_the_last_checkpoint_unless_it_names_one():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    fit = trainer._fit_impl  # Lightning's: the check that its fit still takes ckpt_path
    args, kwargs = resume_from_last(fit, ("model",), {})
    assert kwargs.get("ckpt_path", args[4] if len(args) > 4 else None) == "last"
    args, kwargs = resume_from_last(fit, ("model",), {"ckpt_path": "mine.ckpt"})
    assert kwargs["ckpt_path"] == "mine.ckpt"


def test_a_fit_without_ckpt_path_is_left_alone_with_a_warning(caplog):
    def fit(model, datamodule=None):
        return model

    with caplog.at_level(logging.WARNING):
        assert resume_from_last(fit, ("model",), {}) == (("model",), {})
    assert "starts from scratch" in caplog.text
