"""Lightning's `DDPStrategy` options (and `DistributedDataParallel`'s) given to our strategies.

Our strategies never wrap the model in `DistributedDataParallel`: gradients stay local and the
replicas average their *parameters* in groups. A user moving from
`DDPStrategy(find_unused_parameters=True, static_graph=True, ...)` passes options that are meant
for DDP's gradient reducer. `DDP_OPTIONS` says, for each of them, either why it is accepted as a
no-op here (what it asks for already holds) or why it cannot apply and what to use instead;
`check_ddp_options` applies that table to the keyword arguments a strategy did not recognise.

DDP's `timeout`, `process_group_backend` and `start_method` are options of our strategies too
(`DecentralizedStrategy.__init__`), and so are Lightning's plugins (`accelerator`,
`checkpoint_io`, ...): they never reach this table.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DDPOption:
    """What one DDP option means for our strategies."""

    #: accepted: why the option's purpose is met without it; rejected: why it cannot apply
    why: str
    #: rejected: what to use instead (`None`: the option is accepted)
    instead: str | None = None
    #: accepted only with these values (empty: any value); other values are rejected with `instead`
    only: tuple[Any, ...] = ()

    def accepts(self, value: Any) -> bool:
        return self.instead is None or (bool(self.only) and any(value is v or value == v for v in self.only))


_NO_REDUCER = "no gradient is all-reduced (replicas average parameters in groups, not gradients)"
_NO_BUCKETS = "there are no gradient buckets (replicas average parameters in groups, not gradients)"
_REMOVE = "remove the option"

#: DDP option -> accepted as a no-op (and why) or rejected (why, and what to use instead)
DDP_OPTIONS: dict[str, DDPOption] = {
    # -- accepted: what they ask of DDP's gradient reducer holds here anyway --------------------
    "find_unused_parameters": DDPOption(f"parameters without a gradient are no error: {_NO_REDUCER}"),
    "static_graph": DDPOption(f"there is no gradient reducer to specialise to the graph: {_NO_REDUCER}"),
    "gradient_as_bucket_view": DDPOption(f"gradients stay in each parameter's .grad: {_NO_BUCKETS}"),
    "skip_all_reduce_unused_params": DDPOption(f"unused parameters cost nothing: {_NO_REDUCER}"),
    "batched_grad_copy": DDPOption(f"no gradient is copied into a bucket: {_NO_BUCKETS}"),
    "check_reduction": DDPOption("deprecated and ignored by DistributedDataParallel itself"),
    "dim": DDPOption("inputs are not scattered: every rank loads its own batches"),
    "output_device": DDPOption("outputs stay on the device the module computes them on (one device per rank)"),
    "init_sync": DDPOption(
        "the replicas start from global rank 0's parameters and buffers (broadcast at setup): they must start "
        "equal, so the initial broadcast cannot be skipped",
        instead="remove the option (init_sync=True is what happens anyway)",
        only=(True,),
    ),
    # -- rejected: they configure machinery that does not exist here ----------------------------
    "broadcast_buffers": DDPOption(
        "buffers are not broadcast from rank 0 at every forward: floating-point buffers are averaged with the "
        "parameters in every exchange and at synchronization points, integer and boolean buffers take their "
        "element-wise maximum over the live ranks at every synchronization point",
        instead="remove the option, or broadcast_buffers=False (what happens here)",
        only=(False,),
    ),
    "forward_sync_buffers": DDPOption(
        "buffers are not broadcast from rank 0 at every forward: floating-point buffers are averaged with the "
        "parameters in every exchange and at synchronization points, integer and boolean buffers take their "
        "element-wise maximum over the live ranks at every synchronization point",
        instead=_REMOVE,
    ),
    "bucket_cap_mb": DDPOption(
        _NO_BUCKETS, instead="bucket_mb=... (the size of the flat buffers of parameters averaged in one collective)"
    ),
    "bucket_cap_mb_list": DDPOption(
        _NO_BUCKETS, instead="bucket_mb=... (the size of the flat buffers of parameters averaged in one collective)"
    ),
    "ddp_comm_hook": DDPOption(
        f"a gradient communication hook has nothing to hook: {_NO_REDUCER}",
        instead="sync_every=... (local steps between two exchanges) to communicate less",
    ),
    "ddp_comm_state": DDPOption(
        f"the state of a gradient communication hook has no hook to serve: {_NO_REDUCER}",
        instead="sync_every=... (local steps between two exchanges) to communicate less",
    ),
    "ddp_comm_wrapper": DDPOption(
        f"a gradient communication hook wrapper has nothing to wrap: {_NO_REDUCER}",
        instead="sync_every=... (local steps between two exchanges) to communicate less",
    ),
    "model_averaging_period": DDPOption(
        "DDP's post-local SGD averages every replica periodically; here averaging the replicas in groups is "
        "what the strategy itself does",
        instead="sync_every=... (local steps between two exchanges) and average_at_sync=True (all replicas "
        "averaged at validation, epoch end and end of fit)",
    ),
    "process_group": DDPOption(
        "exchanges run on the library's own process group over every rank, in groups that the strategy forms",
        instead="the strategy's own grouping options (group_size, grouping, topology, schedule, graph)",
    ),
    "device_mesh": DDPOption(
        "the strategies are data parallel over one flat world of ranks, in groups that the strategy forms",
        instead="Trainer(devices=..., num_nodes=...) for the layout; the strategy's own grouping options "
        "(group_size, grouping, topology, schedule, graph)",
    ),
    "device_ids": DDPOption(
        "the Trainer assigns each rank its device", instead="Trainer(accelerator=..., devices=...)"
    ),
    "mixed_precision": DDPOption(
        "DDP's mixed precision casts what its gradient reducer communicates, and there is no such reducer",
        instead="Trainer(precision=...)",
    ),
    "delay_all_reduce_named_params": DDPOption(
        f"there is no gradient all-reduce to delay: {_NO_REDUCER}",
        instead="the exchanges already overlap the next local steps (the strategy's overlap option)",
    ),
    "param_to_hook_all_reduce": DDPOption(
        f"there is no gradient all-reduce to delay: {_NO_REDUCER}",
        instead="the exchanges already overlap the next local steps (the strategy's overlap option)",
    ),
}

_logged: set[str] = set()


def ddp_module_options() -> frozenset[str]:
    """The keyword arguments of `torch.nn.parallel.DistributedDataParallel` in this torch (not `module`)."""
    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return frozenset(names) - {"self", "module"}


def strategy_options(cls: type, base: type) -> list[str]:
    """The named options of `cls.__init__` and of every `__init__` up to `base` (subclasses pass `**kwargs` on)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if issubclass(klass, base) and "__init__" in vars(klass):
            for param in inspect.signature(klass.__init__).parameters.values():
                if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and param.name != "self":
                    names.append(param.name)
    return names


def check_ddp_options(strategy_name: str, kwargs: Mapping[str, Any], options: Iterable[str] = ()) -> None:
    """Accept the DDP options of `kwargs` that are no-ops here (logged at debug level once each), reject the others.

    Raises:
        TypeError: a keyword that is neither an option of the strategy nor DDP's (`options`: the
            strategy's own, offered as close matches).
        ConfigurationError: a DDP option that cannot apply; the message names each such option,
            why, and what to use instead.
    """
    from lightning_prague.core.errors import ConfigurationError

    ddp = ddp_module_options() | DDP_OPTIONS.keys()
    unknown = [name for name in kwargs if name not in ddp]
    if unknown:
        known = sorted(set(options) | ddp)
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(
            f"strategy={strategy_name!r} got unexpected keyword argument(s) {', '.join(hints)}: neither an option "
            "of the strategy nor one of DistributedDataParallel's"
        )
    rejected = []
    for name, value in kwargs.items():
        option = DDP_OPTIONS.get(name)
        if option is None:  # DDP's, in a torch newer than this table
            rejected.append(f"{name}={value!r}: {_NO_REDUCER}; instead: {_REMOVE}")
        elif not option.accepts(value):
            rejected.append(f"{name}={value!r}: {option.why}; instead: {option.instead}")
    if rejected:
        what = rejected[0] if len(rejected) == 1 else "".join(f"\n- {line}" for line in rejected)
        raise ConfigurationError(
            f"strategy={strategy_name!r} cannot honour DistributedDataParallel's {what}\n"
            "(the model is not wrapped in DistributedDataParallel: see 'Options of DDPStrategy' in "
            "docs/api/strategies.md)"
        )
    for name, value in kwargs.items():
        if name not in _logged:
            _logged.add(name)
            log.debug("strategy=%r: ignoring %s=%r: %s", strategy_name, name, value, DDP_OPTIONS[name].why)
