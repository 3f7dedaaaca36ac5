"""A lost worker comes back: the Lightning side of rejoining a running fit.

A new process for a rank that left the job (started again by the strategy's launcher with
`max_restarts`, or by any launcher with `LIGHTNING_PRAGUE_REJOIN=1`; `lightning_prague.core.job.rejoining`)
runs the user's script from its start. Its `fit` is made to resume from `PEER_CHECKPOINT` (the
launcher sets `ckpt_path`), and its strategy restores that checkpoint after its setup, where it was
admitted (`lightning_prague.core.job.Job.rejoin`): the checkpoint is the one a live member, the donor, sent it.

The donor's side (`PeerState`): the control plane admits a joiner at once, with no meeting, in a
membership epoch of its own (`lightning_prague.core.membership`); at its next batch boundary (or
the meeting it waits at, or the end of the epoch's meeting that admitted a joiner with nothing left
in the epoch) the donor, the lowest member that trains, takes Lightning's own checkpoint of that
moment (`dump_checkpoint`: the model, the optimizer (this replica's state, not a mean: the other
members go on training), the LR schedulers, the loops' progress, the callbacks' states), copies its
tensors off the live ones, and sends it in the background while it trains on (`GroupWorker.donate`,
`BackgroundTransfer`). The work queue's part
of it is the epoch's numbering, not the donor's chunks (`ProgressLoader.for_joiner`): the joiner
claims from the epoch under way. A joiner admitted inside an epoch goes on in that epoch
(`epoch_under_way`); under lock-step shards it reads the lost rank's own shard on from where that
rank stood (`resume_epoch_progress`, `lightning_prague.strategies.loaders`); a joiner given a state
taken at an epoch's end (`TAKEN_AT_EPOCH_END`) starts the next epoch with the members. Joiners
admitted in an epoch's end's release are not aligned with the members until the next
synchronization point: until then the members' own collectives run among themselves
(`GroupWorker.fresh`). The checkpoint travels as bytes that
`torch.load(weights_only=True)` reads (`encode_object`): never unpickled. Values a checkpoint can
hold that such a load cannot read (objects of the user's classes in the hyperparameters or a
callback's state) are left out, each named in a warning. The joiner checks that the model it was
given has its own model's parameters (names, shapes, dtypes) before anything is restored; another
model is a `ConfigurationError` that names the differences. The donor's latest logged metrics
(`trainer.callback_metrics`, scalars only) come with it (`MEMBERS_METRICS`): the joiner holds the
members' model, and one admitted at the fit's last epoch's end validates nothing of its own.
"""

from __future__ import annotations

import inspect
import io
import logging
import pathlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_prague.core.comm.collectives import decode_object
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.replicas.sharding import as_local_shards, from_local_shards, is_sharded, model_shards

if TYPE_CHECKING:
    from lightning_prague.strategies.base import DecentralizedStrategy

log = logging.getLogger(__name__)

#: the `ckpt_path` a rejoining process's `fit` resumes from: the state a live member sends it
PEER_CHECKPOINT = "lightning-prague://peer"
#: the key of the donor's latest logged metrics in the state it sends (`members_metrics`)
MEMBERS_METRICS = "lightning_prague_members_metrics"
#: the key of whether the donor took its state at an epoch's end (else inside the epoch) in the state it sends
TAKEN_AT_EPOCH_END = "lightning_prague_taken_at_epoch_end"
#: the key of whether the donor sent its shards of a model sharded over its replica (`shard=True`), not the model
SENT_SHARD_BY_SHARD = "lightning_prague_shard_by_shard"
#: at most this many metrics, each name at most this long, are taken from a donor
MAX_METRICS, MAX_METRIC_NAME = 256, 200

_PLAIN = (type(None), torch.Tensor, pathlib.PurePath)
_SCALARS = (bool, int, float, str)  # subclasses (numpy's float64) become the plain type: a safe load reads only those


def readable(value: Any, where: str, dropped: list[str]) -> Any:
    """`value` with only what `torch.load(weights_only=True)` reads back: tensors, numbers,
    strings, paths, and dicts, lists and tuples of them; anything else is left out (named in `dropped`)."""
    if isinstance(value, _PLAIN):
        return value
    for kind in _SCALARS:
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                dropped.append(f"{where}[{key!r}]")
                continue
            kept = readable(item, f"{where}[{key!r}]", dropped)
            if kept is not _DROPPED:
                out[key] = kept
        return out
    if isinstance(value, (list, tuple)):
        items = [readable(item, f"{where}[{i}]", dropped) for i, item in enumerate(value)]
        items = [item for item in items if item is not _DROPPED]
        return items if isinstance(value, list) else tuple(items)
    dropped.append(f"{where} ({type(value).__name__})")
    return _DROPPED


_DROPPED = object()


class PeerState:
    """The donor's side and the joiner's side of the fit's state (see the module docstring)."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy
        #: True while the donor dumps its checkpoint: the optimizer state is this replica's own
        self.dumping = False

    def snapshot(self, at_epoch_end: bool = False) -> Callable[[], bytes]:
        """The donor's checkpoint of this moment, copied off the live tensors (the donor trains on);
        returns what encodes it as bytes (run in the background: `BackgroundTransfer`). `at_epoch_end`:
        taken at the end of an epoch, once the members met there (the joiner starts the next epoch);
        else at a batch boundary inside it (the joiner goes on in that epoch)."""
        trainer = self.strategy._trainer
        assert trainer is not None
        progress = self.strategy.progress
        loader = progress.loader if progress is not None else None
        self.dumping = True
        if loader is not None:  # the joiner claims from the epoch under way, with none of this rank's chunks
            loader.for_joiner = True
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self.dumping = False
            if loader is not None:
                loader.for_joiner = False
        checkpoint[MEMBERS_METRICS] = scalar_metrics(trainer.callback_metrics)
        checkpoint[TAKEN_AT_EPOCH_END] = bool(at_epoch_end)
        if is_sharded(self.strategy.lightning_module):  # this rank's shards, for the joiner of its index
            checkpoint = as_local_shards(checkpoint)
            checkpoint[SENT_SHARD_BY_SHARD] = True
        kept = self._readable(checkpoint)
        copied = _copied(kept)
        return lambda: _saved(copied)

    def _readable(self, checkpoint: dict[str, Any]) -> Any:
        dropped: list[str] = []
        kept = readable(checkpoint, "checkpoint", dropped)
        if dropped:
            log.warning(
                "rank %d: the state sent to a rejoining rank leaves out what it could not read back: %s",
                self.strategy.global_rank,
                ", ".join(dropped[:10]),
            )
        return kept

    def checkpoint(self, payload: bytes) -> dict[str, Any]:
        """The joiner's side: the donor's checkpoint, checked against this rank's own model."""
        try:
            checkpoint = decode_object(payload)
        except Exception as err:  # not torch.save's format, or something a weights-only load refuses
            raise ConfigurationError(
                f"rank {self.strategy.global_rank}: the state a live member sent it is not a checkpoint "
                f"({type(err).__name__}: {str(err)[:200]})"
            ) from None
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
            raise ConfigurationError(
                f"rank {self.strategy.global_rank}: the state a live member sent it is not a checkpoint"
            )
        if checkpoint.get(SENT_SHARD_BY_SHARD) is True:
            checkpoint = self._rebuilt_shards(checkpoint)
        mine = self.strategy.lightning_module.state_dict()
        theirs = checkpoint["state_dict"]
        differences = [
            f"{name}: {tuple(t.shape)} {t.dtype} here, {_describe(theirs.get(name))} in the job"
            for name, t in mine.items()
            if not isinstance(theirs.get(name), torch.Tensor)
            or theirs[name].shape != t.shape
            or theirs[name].dtype != t.dtype
        ]
        differences += [f"{name}: missing here" for name in theirs if name not in mine]
        if differences:
            raise ConfigurationError(
                f"rank {self.strategy.global_rank} cannot rejoin: its model is not the job's "
                f"({'; '.join(differences[:8])}{'; ...' if len(differences) > 8 else ''})"
            )
        return checkpoint

    def _rebuilt_shards(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The joiner's side of a model sharded over its replica: the donor's shards (this rank's
        index of a live replica) made DTensors of this rank's own model again (`from_local_shards`)."""
        module = self.strategy.lightning_module
        if not is_sharded(module):
            raise ConfigurationError(
                f"rank {self.strategy.global_rank}: a live member sent its shards of a model sharded over its "
                "replica, and this rank's model is not sharded (shard=True on every rank)"
            )
        like = model_shards(module)
        wrong: list[str] = []
        checkpoint["state_dict"], missed = from_local_shards(checkpoint["state_dict"], like)
        wrong += missed
        states = checkpoint.get("optimizer_states")
        if isinstance(states, list):
            for i, state in enumerate(states):
                if isinstance(state, dict):
                    states[i], missed = from_local_shards(state, like)
                    wrong += [f"optimizer {i}'s {what}" for what in missed]
        if wrong:
            raise ConfigurationError(
                f"rank {self.strategy.global_rank} cannot rejoin: the shards a live member sent are not this "
                f"rank's shards of its model ({'; '.join(wrong[:8])}{'; ...' if len(wrong) > 8 else ''})"
            )
        return checkpoint


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The donor's side: its logged metrics that are one number each, as floats."""
    scalars: dict[str, float] = {}
    for name, value in list(metrics.items())[:MAX_METRICS]:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[str(name)] = float(value.detach().cpu())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[str(name)] = float(value)
    return scalars


def members_metrics(value: Any) -> dict[str, torch.Tensor]:
    """The joiner's side: the donor's logged metrics (untrusted input): a mapping of at most
    `MAX_METRICS` names, each at most `MAX_METRIC_NAME` characters, to numbers; anything else is
    dropped. Tensors, as Lightning's own logged metrics are."""
    if not isinstance(value, Mapping):
        return {}
    taken: dict[str, torch.Tensor] = {}
    for name, number in list(value.items())[:MAX_METRICS]:
        if isinstance(name, str) and len(name) <= MAX_METRIC_NAME and type(number) in (int, float):
            taken[name] = torch.tensor(float(number))
    return taken


def _fit_loop(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fit loop's state in `checkpoint` and its epoch loop's batch progress (`{}` where absent)."""
    loops = checkpoint.get("loops")
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    if not isinstance(fit_loop, dict):
        return {}, {}
    progress = fit_loop.get("epoch_loop.batch_progress")
    return fit_loop, progress if isinstance(progress, dict) else {}


def epoch_under_way(checkpoint: dict[str, Any]) -> None:
    """Make `checkpoint` (a donor's, taken at a batch boundary inside an epoch) resume that epoch, even
    if the donor had reached its last batch: the joiner's epoch ends when its own data does."""
    _, progress = _fit_loop(checkpoint)
    if progress:
        progress["is_last_batch"] = False


def held_inside_epoch(checkpoint: dict[str, Any]) -> bool:
    """Whether the work queue's state in `checkpoint` (`ProgressLoader.state_dict`) holds chunks handed
    out and not trained, or shards in progress: its epoch goes on, whatever Lightning's fetcher, which
    looks a batch ahead, said of the epoch's last batch (a checkpoint at the step budget)."""
    fit_loop, _ = _fit_loop(checkpoint)
    state = fit_loop.get("state_dict")
    loaders = state.get("combined_loader") if isinstance(state, dict) else None
    if not isinstance(loaders, list):
        return False
    return any(isinstance(s, dict) and bool(s.get("pending") or s.get("positions")) for s in loaders)


def resume_epoch_progress(checkpoint: dict[str, Any], batches: int, accumulate: int = 1) -> None:
    """Make `checkpoint` (a donor's, taken inside an epoch) resume its epoch's loop at `batches`: where
    the lost rank this process replaces stood in its own shard, not where the donor stands. Its step
    counts (the global step, what LR schedules follow) move back or on by as many steps."""
    fit_loop, progress = _fit_loop(checkpoint)
    current = progress.get("current")
    if not isinstance(current, dict) or not isinstance(current.get("ready"), int):
        raise ConfigurationError("the state a live member sent holds no training loop progress to resume from")
    shift = batches - int(current["ready"])  # batches; steps: `shift // accumulate`
    _shift_counters(progress, shift)
    progress["is_last_batch"] = False
    steps = shift // max(1, accumulate)
    automatic = fit_loop.get("epoch_loop.automatic_optimization.optim_progress")
    _shift_counters(automatic.get("optimizer") if isinstance(automatic, dict) else None, steps)
    _shift_counters(fit_loop.get("epoch_loop.manual_optimization.optim_step_progress"), steps)
    state = fit_loop.get("epoch_loop.state_dict")
    if isinstance(state, dict) and isinstance(state.get("_batches_that_stepped"), int):
        state["_batches_that_stepped"] = max(0, state["_batches_that_stepped"] + steps)
    if isinstance(checkpoint.get("global_step"), int):
        checkpoint["global_step"] = max(0, checkpoint["global_step"] + steps)


def _shift_counters(tree: Any, shift: int) -> None:
    """Add `shift` to every loop counter (`ready`, `started`, `processed`, `completed`) under `tree`."""
    if not isinstance(tree, dict):
        return
    for key, value in tree.items():
        if key in ("ready", "started", "processed", "completed") and isinstance(value, int):
            tree[key] = max(0, value + shift)
        else:
            _shift_counters(value, shift)


def _copied(value: Any) -> Any:
    """`value` (what `readable` kept) with each tensor copied to the CPU: a snapshot training cannot change."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_copied(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _saved(value: Any) -> bytes:
    """`value` as `torch.save` writes it: what `readable` kept, a weights-only load reads back (`decode_object`)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return "absent"


def with_checkpoint(
    function: Callable, args: tuple, kwargs: dict[str, Any], path: str, force: bool = False
) -> tuple[tuple, dict[str, Any]]:
    """`function`'s arguments with `ckpt_path=path`, unless one was given and not `force`."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    if bound is None or "ckpt_path" not in inspect.signature(function).parameters:
        log.warning("this Lightning version's fit takes no ckpt_path: a restarted fit starts from scratch")
        return args, kwargs
    if force or bound.arguments.get("ckpt_path") is None:
        log.warning(
            "the job was restarted: resuming the fit from %s", "the last checkpoint" if path == "last" else path
        )
        bound.arguments["ckpt_path"] = path
    return bound.args, bound.kwargs
