"""Replica groups in a strategy (`replica_size`, issue 50): `decent_adam`'s ranks (and `prague`'s with
its static schedule) train in replicas of consecutive ranks, synchronously inside each
(`DistributedDataParallel` on the replica's own process group) and by gossip across them, column by
column. Real fits of 4 and 6 ranks on gloo, started as
a cluster launcher starts them (`scripts/replica_fit.py`), and the options refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_script_ranks

import lightning_prague
import lightning_prague.demo.run  # noqa: F401  (imported once here: the ranks are forked from this process)
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.policies import SchedulePolicy, policy_from_spec
from lightning_prague.core.grouping.topology import make_topology
from lightning_prague.core.records import BadRecord
from lightning_prague.core.replicas import ReplicaLayout, column_schedule

pytestmark = pytest.mark.timeout(120)


def results(directory) -> dict[int, dict]:
    found = [json.loads(p.read_text()) for p in directory.glob("replica.rank*.json")]
    return {r["rank"]: r for r in found}


def four_ranks_in_replicas(tmp_path, argv: list[str]) -> dict[int, dict]:
    """Run 4 ranks in replicas of 2 to the end of the fit: each replica's ranks bitwise one model after
    every recorded step; their results."""
    codes, logs = run_script_ranks(tmp_path, 4, "replica_fit.py", argv)
    assert codes == [0] * 4, (codes, logs[0][-3000:])
    found = results(tmp_path)
    assert sorted(found) == [0, 1, 2, 3]
    for first, second in ((0, 1), (2, 3)):
        assert found[first]["digests"] == found[second]["digests"], f"replica of ranks {first} and {second}"
    return found


def replica_lost(tmp_path, argv: list[str], killed: int, mate: int) -> dict[int, dict]:
    """Run 6 ranks in replicas of 2 where `killed` (of the replica of ranks 2 and 3) is killed: its mate
    fails and names it, the other replicas finish with one model, each replica's ranks bitwise one
    model throughout (the rounds around the loss included); their results."""
    codes, logs = run_script_ranks(tmp_path, 6, "replica_fit.py", argv)
    assert codes[killed] == -9 and codes[mate] not in (0, None), (codes, logs[mate][-3000:])
    said = f"rank {mate} leaves the job with its replica (ranks [2, 3]): rank(s) [{killed}] of it were lost"
    assert said in logs[mate], logs[mate][-3000:]
    assert [codes[r] for r in (0, 1, 4, 5)] == [0] * 4, (codes, logs[0][-3000:])
    found = results(tmp_path)
    assert sorted(found) == [0, 1, 4, 5]
    for first, second in ((0, 1), (4, 5)):  # through the loss too: every column of a replica mixed alike
        assert found[first]["digests"] == found[second]["digests"], f"replica of ranks {first} and {second}"
    assert len({r["final"] for r in found.values()}) == 1, "one model"
    assert all(set(r["lost"]) == {2, 3} for r in found.values()), [r["lost"] for r in found.values()]
    return found


@pytest.mark.parametrize("strategy", ["decent_adam", "prague-static"])
def test_the_ranks_of_a_replica_step_as_one_model_and_the_replicas_gossip(tmp_path, strategy):
    """4 ranks in replicas of 2: after every step the two ranks of a replica hold bitwise one model
    (their gradients averaged, their columns mixed alike), the two replicas hold different ones (each
    its own batches between mixes), and the fit ends with one model that learned the digits. A rank's
    sums across replicas are of its half of the model."""
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--strategy", strategy]
    found = four_ranks_in_replicas(tmp_path, argv)
    steps = list(zip(found[0]["digests"], found[2]["digests"]))
    assert len(steps) == 24 and all(a != b for a, b in steps), "the replicas train apart between their mixes"
    assert len({r["final"] for r in found.values()}) == 1, "one model at the end of the fit"
    assert found[0]["val_acc"] >= 0.85, found[0]["val_acc"]
    assert {r["batches"] for r in found.values()} == {found[0]["batches"]}, "equal shards: every rank's own batches"
    for result in found.values():  # each rank sends its half of the model across replicas, never the whole
        half = result["state_elements"] / 2
        assert result["column_sums"] and all(half - 1 <= n <= half + 1 for n in result["column_sums"]), result


@pytest.mark.serial  # the fast replica must take more of the queue: relative speeds, measured alone
@pytest.mark.parametrize(
    "strategy,shard,pace",
    [("prague", False, None), ("partial_reduce", True, None), ("adpsgd", False, None),
     ("decent_adam", True, "own")],
)  # fmt: skip
def test_work_queue_replicas_take_batches_by_speed_and_step_as_one_model(tmp_path, strategy, shard, pace):
    """The work-queue strategies in replicas of 2 (4 ranks), the second replica's ranks 4x slower: a
    replica claims one chunk for its two ranks, who train its two halves and so take the same steps,
    holding bitwise one model after every step (DDP, or FSDP2's shards, inside the replica; each rank's
    slice or shard averaged with its column, and the slices put back together); the fast replica
    trains more batches; every training sample of every epoch is trained exactly once (but for the
    last chunk's padding); the fit ends with one model, and each rank sends only its half across.
    A schedule at each replica's own pace (`pace="own"`: `decent_adam`'s ring, sharded; `prague`'s static
    schedule runs the same rounds) too: the fast replica takes local steps while its round waits for the
    slow one, and the replica's ranks mix each round in at the same step."""
    # two epochs: the test runs alone (serial), so it is kept short
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--strategy", strategy, "--indexed",
            "--slow", "2:0.04", "--slow", "3:0.04", "--epochs", "2"]  # fmt: skip
    if shard:
        argv.append("--shard")
    if pace:
        argv += ["--pace", pace]
    found = four_ranks_in_replicas(tmp_path, argv)
    for first, second in ((0, 1), (2, 3)):
        assert found[first]["batches"] == found[second]["batches"], "a replica's ranks take the same steps"
    assert any(a != b for a, b in zip(found[0]["digests"], found[2]["digests"])), "the replicas train apart"
    assert found[0]["batches"] > 1.5 * found[2]["batches"], "the fast replica takes more of the queue"
    if pace == "own":  # the fast replica trains on while its round waits for the slow one, both ranks alike
        assert found[0]["local_steps"] == found[1]["local_steps"] > 0, [r["local_steps"] for r in found.values()]
        assert found[2]["local_steps"] == found[3]["local_steps"]
    assert len({r["final"] for r in found.values()}) == 1, "one model at the end of the fit"
    assert found[0]["val_acc"] >= 0.85, found[0]["val_acc"]
    train_size = 1438  # the digits' training split
    for epoch in ("0", "1"):
        trained = [i for r in found.values() for i in r["samples"][epoch]]
        assert set(trained) == set(range(train_size)), f"epoch {epoch}: every sample trained"
        assert len(trained) - train_size <= 1, f"epoch {epoch}: once each (but for the last chunk's padding)"
    for result in found.values():
        if shard:
            assert max(result["column_sums"]) == result["state_elements"], "its own shards, no slice of them"
        else:
            half = result["state_elements"] / 2
            assert all(half - 1 <= n <= half + 1 for n in result["column_sums"]), result["column_sums"]


def test_a_model_sharded_over_each_replica_trains_shard_by_shard_and_checkpoints_whole_or_shard_by_shard(tmp_path):
    """`shard=True`, 4 ranks in replicas of 2: each rank holds half of every parameter (FSDP2 over its
    replica), the replica's two ranks make one model (gathered, bitwise the same after every step),
    the replicas differ between mixes and end as one; each rank's sums across replicas are of its own
    shards, nothing more; and the checkpoint holds the whole model, which a plain module loads. A fit
    resumed from it saves its own shard by shard (`state_dict_type="sharded"`), which is read back by
    this library and by plain Lightning (`sharded_checkpoint_is_read_by_this_library_and_by_plain_lightning`)."""
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--shard"]
    codes, logs = run_script_ranks(tmp_path, 4, "replica_fit.py", argv)
    assert codes == [0] * 4, (codes, logs[0][-3000:])
    found = results(tmp_path)
    for first, second in ((0, 1), (2, 3)):
        assert found[first]["digests"] == found[second]["digests"], f"replica of ranks {first} and {second}"
    assert all(a != b for a, b in zip(found[0]["digests"], found[2]["digests"])), "the replicas train apart"
    assert len({r["final"] for r in found.values()}) == 1, "one model at the end of the fit"
    for result in found.values():
        assert result["sharded"] and result["state_elements"] < 0.6 * result["model_elements"], result
        assert max(result["column_sums"]) == result["state_elements"], "its own shards, no slice of them"
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    plain_module_at_the_fits_accuracy(checkpoint["state_dict"])
    assert "net.0.weight" in checkpoint["optimizer_states"][0]["state"], "the optimizer's state whole, by name"
    # and a sharded fit resumes from it: one more epoch, from the step it stood at, split into shards again
    # (by a module that shards itself in configure_model on the strategy's mesh: the checkpoint loads into shards)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    last = tmp_path / "ckpt" / "last.ckpt"
    argv = ["--out", str(resumed), "--replica-size", "2", "--shard", "--epochs", "4", "--resume", str(last),
            "--configure-model"]  # fmt: skip
    argv += ["--state-dict-type", "sharded"]  # and saves its checkpoints shard by shard (DCP)
    codes, logs = run_script_ranks(resumed, 4, "replica_fit.py", argv)
    assert codes == [0] * 4, (codes, logs[0][-3000:])
    again = results(resumed)
    assert {r["global_step"] for r in again.values()} == {checkpoint["global_step"] * 4 // 3}, "one more epoch of steps"
    assert {r["batches"] for r in again.values()} == {checkpoint["global_step"] // 3}
    assert len({r["final"] for r in again.values()}) == 1 and again[0]["val_acc"] >= 0.85
    sharded_checkpoint_is_read_by_this_library_and_by_plain_lightning(resumed, again)


def plain_module_at_the_fits_accuracy(state_dict: dict):
    """A plain digits module that loads `state_dict` strictly (every tensor whole, by its plain name) and
    classifies the validation set at the accuracy of a fit (85%)."""
    from lightning_prague.demo import DigitsClassifier, DigitsDataModule

    model = DigitsClassifier()
    model.load_state_dict(state_dict)
    data = DigitsDataModule()
    data.setup("fit")
    x, y = data.val_set.tensors
    with torch.no_grad():
        assert float((model.eval()(x).argmax(-1) == y).float().mean()) >= 0.85
    return model


def parameters_digest(module) -> str:
    """SHA-256 of a whole module's parameters, in order (as `scripts/replica_fit.py` digests a model)."""
    import hashlib

    data = b"".join(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for p in module.parameters())
    return hashlib.sha256(data).hexdigest()


def sharded_checkpoint_is_read_by_this_library_and_by_plain_lightning(run: Path, results_of_run: dict) -> None:
    """`run`'s last checkpoint, saved shard by shard: one replica's two ranks wrote a shard file each, no
    whole model; consolidated into one file it is the whole model, which a plain module loads and a plain
    single-process Lightning fit resumes from; and a sharded fit resumes from the directory itself."""
    import lightning as L

    from lightning_prague.demo import DigitsClassifier, DigitsDataModule
    from lightning_prague.tools import consolidate

    directory = run / "ckpt" / "last.ckpt"
    assert directory.is_dir() and (directory / "meta.pt").is_file(), sorted(p.name for p in run.rglob("*"))
    shard_files = sorted(directory.glob("*.distcp"))
    assert len(shard_files) == 2, "the writing replica's two ranks, one file each"
    whole_bytes = 4 * sum(p.numel() for p in DigitsClassifier().parameters())
    shares = [f.stat().st_size / (3 * whole_bytes) for f in shard_files]  # its shards of the model and of SGD's state
    assert all(share < 0.75 for share in shares), shares
    consolidated = run / "consolidated.ckpt"
    consolidate.main([str(directory), "--out", str(consolidated)])
    checkpoint = torch.load(consolidated, weights_only=True)
    model = plain_module_at_the_fits_accuracy(checkpoint["state_dict"])
    step = checkpoint["global_step"]
    assert step == next(iter(results_of_run.values()))["global_step"], "the last epoch's checkpoint"
    plain = L.Trainer(accelerator="cpu", devices=1, max_epochs=checkpoint["epoch"] + 2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, default_root_dir=run)  # fmt: skip
    plain_data = DigitsDataModule(batch_size=32)
    plain.fit(DigitsClassifier(lr=0.05), plain_data, ckpt_path=consolidated)  # optimizer state included
    assert plain.current_epoch == checkpoint["epoch"] + 2 and plain.global_step == step + plain.num_training_batches
    # a sharded fit of this library resumes from the directory itself, each rank reading its own shards
    again = run / "again"
    again.mkdir()
    argv = ["--out", str(again), "--replica-size", "2", "--shard", "--epochs", str(checkpoint["epoch"] + 2),
            "--resume", str(directory), "--state-dict-type", "sharded"]  # fmt: skip
    codes, logs = run_script_ranks(again, 4, "replica_fit.py", argv)
    assert codes == [0] * 4, (codes, logs[0][-3000:])
    resumed = results(again)
    assert {r["start"] for r in resumed.values()} == {parameters_digest(model)}, "the checkpoint's model, every rank"
    assert {r["global_step"] for r in resumed.values()} == {step + step // (checkpoint["epoch"] + 1)}, "one more epoch"
    assert len({r["final"] for r in resumed.values()}) == 1 and resumed[0]["val_acc"] >= 0.85


def test_a_lost_rank_loses_its_replica_and_the_other_replicas_finish_with_one_model(tmp_path):
    """6 ranks in replicas of 2; rank 3 is killed at its 10th batch: rank 2, its replica's other rank,
    fails at its next gradient average and leaves; ranks 0, 1, 4 and 5 finish the fit with one model,
    the replica of ranks 2 and 3 taking no part in their gossip after it was lost. The ranks of each
    surviving replica hold one model after every step, the rounds around the loss included (a
    round is decided for all columns of its replicas at once)."""
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--kill", "3:10"]
    found = replica_lost(tmp_path, argv, killed=3, mate=2)
    assert found[0]["val_acc"] >= 0.85, found[0]["val_acc"]


@pytest.mark.parametrize("killed,mate", [(2, 3), (3, 2)])
def test_a_work_queue_replica_that_loses_a_rank_leaves_and_its_chunks_are_trained_by_the_others(tmp_path, killed, mate):
    """`prague` in replicas of 2 (6 ranks); a rank of the second replica is killed at its 2nd batch (a
    replica slowed by the machine's load may train only its set-aside batch of each epoch, so a later
    one might never come): its leader, rank 2 (the rank that claims for it), or its follower, rank 3
    (which takes its chunks from rank 2's claims). The other rank of that replica fails (its
    replica's gradient average, or its next chunk, whichever comes first) and leaves, naming the lost
    one; the other two replicas finish with one model, each replica's ranks bitwise one model
    throughout, and every sample of the epochs after the loss is trained by them."""
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--strategy", "prague", "--indexed",
            "--kill", f"{killed}:2"]  # fmt: skip
    found = replica_lost(tmp_path, argv, killed=killed, mate=mate)
    for first, second in ((0, 1), (4, 5)):
        assert found[first]["batches"] == found[second]["batches"]
    for epoch in ("1", "2"):  # after the loss: the two replicas left train the whole epoch between them
        trained = [i for r in found.values() for i in r["samples"][epoch]]
        assert set(trained) == set(range(1438)) and len(trained) - 1438 <= 1, epoch
    assert found[0]["val_acc"] >= 0.85, found[0]["val_acc"]


@pytest.mark.parametrize("strategy,struck", [("prague", "3:5"), ("decent_adam", "1:5")])
def test_sigterm_on_a_replicas_rank_stops_every_replica_at_one_step_with_one_model(tmp_path, strategy, struck):
    """4 ranks in replicas of 2, 30 epochs; a replica's second rank gets SIGTERM at its 5th batch. The
    stop reaches the ranks of each replica at their own batches (the struck rank at once, the others
    when the control plane's announcement arrives). Under the work queue (`prague`) each replica's
    first rank ends its data instead and both its ranks end the epoch at the same chunk; under the
    lock-step `decent_adam` the replica's ranks agree on the stop one batch after the first of them saw
    it (without that, the struck rank stopped while its mate went into the next gradient average, and
    failed). Every rank meets at the stop point within the first epoch and stops (Lightning's SIGTERM)
    with one model, the replicas' ranks never apart."""
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--strategy", strategy, "--epochs", "30",
            "--sigterm", struck]  # fmt: skip
    codes, logs = run_script_ranks(tmp_path, 4, "replica_fit.py", argv)
    assert codes == [1] * 4, (codes, logs[3][-3000:])
    stopped = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("stopped.rank*.json"))}
    assert sorted(stopped) == [0, 1, 2, 3] and {r["error"] for r in stopped.values()} == {"SIGTERMException"}
    assert all(r["epoch"] == 0 for r in stopped.values()), [r["epoch"] for r in stopped.values()]
    assert len({r["final"] for r in stopped.values()}) == 1, "one model at the stop point"
    for first, second in ((0, 1), (2, 3)):
        assert stopped[first]["batches"] == stopped[second]["batches"], "a replica's ranks stop at one step"
        assert stopped[first]["digests"] == stopped[second]["digests"]
    assert not list(tmp_path.glob("replica.rank*.json")), "no fit ran to its end"


@pytest.mark.parametrize("strategy,asking", [("decent_adam", "1:5"), ("prague", "3:5")])
def test_a_stop_set_on_one_rank_of_a_replica_ends_every_replica_at_one_step(tmp_path, strategy, asking):
    """4 ranks in replicas of 2, 30 epochs; one rank alone sets `trainer.should_stop` at the end of its
    5th batch (as a `Timer` on that rank would). Lightning would end that rank's epoch at once while its
    replica's other rank went into the next gradient average: the stop is held back until the replica
    agrees on it (lock-step `decent_adam`), or until the replica's data ends (work queue). Every rank
    ends the fit normally after the first epoch, with one model, each replica's ranks at one step."""
    argv = ["--out", str(tmp_path), "--replica-size", "2", "--strategy", strategy, "--epochs", "30",
            "--stop-request", asking]  # fmt: skip
    found = four_ranks_in_replicas(tmp_path, argv)
    assert {r["epoch"] for r in found.values()} == {1}, "stopped after the first of 30 epochs"
    assert len({r["final"] for r in found.values()}) == 1, "one model"
    for first, second in ((0, 1), (2, 3)):
        assert found[first]["batches"] == found[second]["batches"], "a replica's ranks end at one step"


@pytest.mark.parametrize(
    "replica_size,max_steps,val_every,validations",
    [(1, 17, None, [12]), (2, 17, None, [12]), (1, 19, 7, [7, 19])],
)
def test_a_step_budget_inside_an_epoch_trains_as_ddp_would_with_or_without_replicas(
    tmp_path, replica_size, max_steps, val_every, validations
):
    """`prague` on 4 ranks with a step budget inside the second epoch: 12 steps of the digits' first
    epoch (45 batches of 32, padded to whole steps of 4 batches), then the rest of the budget, as DDP
    on 4 ranks would train them. Every sample of epoch 0 once, exactly the budget's batches of epoch 1,
    none twice, every rank at the budget's step with one model, and validation at the same steps on
    every rank: at the first epoch's end only, or every 7 steps of an epoch, one of them on the budget.

    Two bugs this found: with replicas, a chunk claimed ahead before the epoch's set-aside ticket was
    taken came without its ticket, and each rank of the replica claimed one of its own, so the budget
    counted the replica's steps twice and ended 2 chunks early; and at a budget inside an epoch the
    ranks whose last batch Lightning saw as the epoch's last validated while the ranks whose claim
    failed at the budget did not, so their collectives crossed (gloo aborted: "Received data size
    doesn't match expected size")."""
    argv = ["--out", str(tmp_path), "--replica-size", str(replica_size), "--strategy", "prague", "--epochs", "30",
            "--max-steps", str(max_steps), "--indexed"]  # fmt: skip
    argv += ["--val-every", str(val_every)] if val_every else []
    if replica_size == 1:
        codes, logs = run_script_ranks(tmp_path, 4, "replica_fit.py", argv)
        assert codes == [0] * 4, (codes, [log[-2000:] for log in logs])
        found = results(tmp_path)
    else:
        found = four_ranks_in_replicas(tmp_path, argv)
    assert sorted(found) == [0, 1, 2, 3]
    assert {r["global_step"] for r in found.values()} == {max_steps}
    assert len({r["final"] for r in found.values()}) == 1, "one model"
    assert all(r["validations"] == validations for r in found.values()), [r["validations"] for r in found.values()]
    first = [i for r in found.values() for i in r["samples"]["0"]]
    second = [i for r in found.values() for i in r["samples"]["1"]]
    assert sorted(first) == list(range(1438)), "epoch 0: every sample once"
    assert len(second) == len(set(second)) == (max_steps - 12) * 4 * 32, "epoch 1: the budget's steps, as DDP"


@pytest.mark.parametrize(
    "strategy,kwargs,message",
    [
        ("DecentAdamStrategy", {"replica_size": 0}, "replica_size=0 is invalid"),
        ("DecentAdamStrategy", {"replica_size": "gpu"}, "replica_size='gpu' is invalid"),
        ("DecentAdamStrategy", {"replica_size": 2, "pace": "round", "max_restarts": 1}, "use pace='own', or set max"),
        (
            "PartialAllReduceStrategy",
            {"grouping": "static", "replica_size": "node", "pace": "round", "max_restarts": 2},
            "pace='own'",
        ),
        ("DecentAdamStrategy", {"replica_size": 2, "shard": True, "pace": "round", "max_restarts": 1}, "pace='own'"),
        ("DecentAdamStrategy", {"replica_size": 2, "max_workers": 8}, "leave max_workers unset"),
        ("DecentAdamStrategy", {"shard": True}, "shard=True shards the model over the ranks of a replica"),
        ("PartialAllReduceStrategy", {"grouping": "static", "shard": "yes", "replica_size": 2}, "shard='yes'"),
        ("DecentAdamStrategy", {"replica_size": 2, "state_dict_type": "dcp"}, "state_dict_type='dcp' is invalid"),
        ("DecentAdamStrategy", {"replica_size": 2, "state_dict_type": "sharded"}, "set shard=True"),
        ("DecentAdamStrategy", {"replica_size": 2, "auto_wrap_policy": {torch.nn.Linear}}, "set shard=True"),
        ("PartialReduceStrategy", {"replica_size": 2, "shard": True, "auto_wrap_policy": ["torch.nn.Nope"]}, "Nope"),
        ("ADPSGDStrategy", {"replica_size": 2, "shard": True, "auto_wrap_policy": {int}}, "not a torch.nn.Module"),
    ],
)
def test_replica_sizes_no_fit_can_use_are_refused_by_name(strategy, kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        getattr(lightning_prague, strategy)(**kwargs)


def test_a_column_schedule_travels_to_the_plane_with_its_coupled_ranks_and_a_bad_one_is_refused():
    policy = SchedulePolicy(column_schedule(make_topology("ring", 4, 1), ReplicaLayout(8, 2)))
    spec = policy.spec()
    assert spec["coupled"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    rebuilt = policy_from_spec(json.loads(json.dumps(spec)))

    def groups(schedule):
        return [[(g.members, g.self_weight) for g in round_] for round_ in schedule.rounds]

    assert rebuilt.schedule.coupled == policy.schedule.coupled and groups(rebuilt.schedule) == groups(policy.schedule)
    with pytest.raises(ConfigurationError, match="never mixes"):  # without its coupling, columns never meet
        policy_from_spec({k: v for k, v in spec.items() if k != "coupled"})
    with pytest.raises(ConfigurationError, match="coupled rank 8 is outside a world of 8"):
        policy_from_spec({**spec, "coupled": [[0, 1], [8, 9]]})
    with pytest.raises(BadRecord, match="coupled"):
        policy_from_spec({**spec, "coupled": [["0"]]})
