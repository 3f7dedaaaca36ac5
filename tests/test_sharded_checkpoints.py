"""Checkpoints saved shard by shard (`state_dict_type="sharded"`, `lightning_prague.strategies.sharded_checkpoints`),
in one process: the layout a plain Lightning job reads, `consolidate` into one file, and what is refused.
The real fits that write and read them: `test_replica_groups.py` (the sharded-model test)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.strategies.sharded_checkpoints import (
    METADATA_FILE,
    agreed_path,
    consolidate,
    is_sharded_checkpoint,
    load_sharded,
)
from lightning_prague.tools import consolidate as consolidate_tool

pytestmark = pytest.mark.timeout(60)


def trained_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def write_checkpoint(directory, model, optimizer, metadata=None) -> None:
    """The layout the strategy writes (one process here: one 'shard' holding everything)."""
    state = {"state_dict": model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    torch.save(metadata if metadata is not None else {"epoch": 2, "global_step": 30}, directory / METADATA_FILE)


def test_consolidate_gives_the_whole_model_and_an_optimizer_state_a_plain_optimizer_loads(tmp_path):
    model, optimizer = trained_model()
    directory = tmp_path / "last.ckpt"
    write_checkpoint(directory, model, optimizer)
    assert is_sharded_checkpoint(directory) and not is_sharded_checkpoint(tmp_path / "none")
    checkpoint = consolidate(directory)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (2, 30), "the rest of the checkpoint, from meta.pt"
    fresh = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    fresh.load_state_dict(checkpoint["state_dict"])  # strict
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    plain = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    plain.load_state_dict(checkpoint["optimizer_states"][0])  # by name, in the optimizer's order
    for mine, theirs in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(plain.state[mine]["momentum_buffer"], optimizer.state[theirs]["momentum_buffer"])
    assert plain.param_groups[0]["lr"] == 0.1
    # the command line writes the same into a file
    consolidate_tool.main([str(directory)])
    written = torch.load(tmp_path / "last.ckpt.consolidated", weights_only=True)
    assert written["state_dict"].keys() == checkpoint["state_dict"].keys()


def test_a_directory_that_is_not_such_a_checkpoint_is_refused_by_name(tmp_path, capsys):
    model, optimizer = trained_model()
    directory = tmp_path / "partial"
    write_checkpoint(directory, model, optimizer)
    (directory / METADATA_FILE).unlink()  # a writer died before it wrote the rest
    with pytest.raises(ConfigurationError, match="not a checkpoint saved shard by shard.*meta.pt"):
        consolidate(directory)
    with pytest.raises(ConfigurationError, match="not a checkpoint saved shard by shard"):
        load_sharded(tmp_path / "missing", model, [optimizer])
    with pytest.raises(SystemExit):
        consolidate_tool.main([str(directory)])
    assert "not a checkpoint saved shard by shard" in capsys.readouterr().err


def test_loading_into_a_module_with_other_optimizers_is_refused_by_name(tmp_path):
    model, optimizer = trained_model()
    directory = tmp_path / "ckpt"
    write_checkpoint(directory, model, optimizer)
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="holds the state of 1 optimizer.*configures 2"):
        load_sharded(directory, model, [optimizer, second])
    # and with the same optimizers it loads, each rank its own (here: all) of every tensor
    target, target_optimizer = trained_model()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    assert load_sharded(directory, target, [target_optimizer])["global_step"] == 30
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), model.parameters()))


class Planted:
    """What a hostile `meta.pt` would run when unpickled."""

    def __reduce__(self):
        return (exec, ("open('planted', 'w').write('ran')",))


def test_a_metadata_file_that_runs_code_is_refused_and_does_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optimizer = trained_model()
    directory = tmp_path / "hostile"
    write_checkpoint(directory, model, optimizer, metadata={"epoch": 1, "payload": Planted()})
    with pytest.raises(pickle.UnpicklingError):
        consolidate(directory)
    with pytest.raises(pickle.UnpicklingError):
        load_sharded(directory, model, [optimizer])
    assert not (tmp_path / "planted").exists()
    torch.save(["not", "a", "dict"], directory / METADATA_FILE)
    with pytest.raises(ConfigurationError, match="does not hold a checkpoint's metadata"):
        load_sharded(directory, model, [optimizer])


def test_a_path_too_long_to_agree_on_is_refused_before_any_collective():
    with pytest.raises(ConfigurationError, match="too long"):
        agreed_path("x" * 5000, group=None, source=0, device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="NUL"):
        agreed_path("a\0b", group=None, source=0, device=torch.device("cpu"))
