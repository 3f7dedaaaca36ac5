"""The private parts of torch.distributed the package uses, and the check that the installed torch has them.

Rebuilding the library's process group under a name and store of ours, and finding the default
group's store, use private parts of `torch.distributed.distributed_c10d`. `TORCH_INTERNALS` lists
every one the package uses (tests/test_torch_internals.py holds it to the code), and `init_job`
checks first that the installed torch has each (`check_torch_internals`): a torch release that
renamed one fails when the job starts, with a `ConfigurationError` naming it, not when a rank is lost.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lightning_prague.core.errors import ConfigurationError

#: the torch releases this one is meant for; the `torch` dependency in pyproject.toml says the same
#: (tests/test_torch_internals.py holds them together)
SUPPORTED_TORCH = ">=2.13"


@dataclass(frozen=True)
class TorchInternal:
    """One private part of `torch.distributed.distributed_c10d` that this package uses, and what for.

    `name` is its path in that module (`"_world.pg_map"`). A `called` one must be callable, with the
    arguments the package passes: `arguments` positional ones and the keyword ones `keywords`.
    """

    name: str
    purpose: str
    called: bool = False
    arguments: int = 0
    keywords: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """Its full name, as messages show it."""
        return f"torch.distributed.distributed_c10d.{self.name}"


#: every private part of torch.distributed the package uses; `init_job` checks each before any use
TORCH_INTERNALS: tuple[TorchInternal, ...] = (
    TorchInternal(
        "_get_default_store",
        "the default group's store, where the control plane's address is, in raw_store",
        called=True,
    ),
    TorchInternal(
        "_get_default_group", "the default group: this rank and device in a rebuilt group, in _new_group", called=True
    ),
    TorchInternal(
        "_world.pg_map",
        "the default group's store with its prefix, on which a rebuilt group meets, in _default_store; the "
        "number of process groups, in lightning_prague.core.comm.groups.communicator_count",
    ),
    TorchInternal("_world.pg_group_ranks", "a rebuilt group's ranks, registered as new_group does, in _new_group"),
    TorchInternal(
        "ProcessGroup.bound_device_id", "the device a rebuilt group is bound to, the default group's, in _new_group"
    ),
    TorchInternal("GroupName", "a rebuilt group's name, its store prefix, in _new_group", called=True, arguments=1),
    TorchInternal(
        "_new_process_group_helper",
        "rebuilding the job's group among the survivors under a name and on a store of ours, in _new_group",
        called=True,
        arguments=6,
        keywords=("timeout", "device_id", "group_desc"),
    ),
    TorchInternal("_set_pg_timeout", "a rebuilt group's operation timeout, in Job.regroup", called=True, arguments=2),
)


def missing_torch_internal(internal: TorchInternal) -> Optional[str]:
    """What the installed torch lacks of `internal`, as a message names it; `None` when it is there."""
    found: object = dist.distributed_c10d
    path = "torch.distributed.distributed_c10d"
    for part in internal.name.split("."):
        path = f"{path}.{part}"
        try:
            found = getattr(found, part)
        except AttributeError:
            return f"{path} ({internal.purpose}) is missing"
    if not internal.called:
        return None
    if not callable(found):
        return f"{path} ({internal.purpose}) is not callable (a {type(found).__name__})"
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # a builtin or a typing construct: being callable is all we can check
        return None
    try:
        signature.bind(*[None] * internal.arguments, **dict.fromkeys(internal.keywords))
    except TypeError as err:
        takes = f"{internal.arguments} positional arguments" + "".join(f", {k}=" for k in internal.keywords)
        return f"{path} ({internal.purpose}) does not take {takes} ({err}; it is {path.rsplit('.', 1)[1]}{signature})"
    return None


def check_torch_internals() -> None:
    """Raise `ConfigurationError` naming every entry of `TORCH_INTERNALS` that the installed torch
    lacks (or that does not take the arguments the package passes), and the installed version."""
    missing = [found for internal in TORCH_INTERNALS if (found := missing_torch_internal(internal))]
    if missing:
        raise ConfigurationError(
            f"lightning-prague relies on private parts of torch.distributed that the installed torch=="
            f"{torch.__version__} does not provide: {'; '.join(missing)}. This release of lightning-prague "
            f"requires torch{SUPPORTED_TORCH} and uses them as torch 2.13 has them: install a torch release "
            f"that has them and pin it in your requirements, or use a lightning-prague release that supports "
            f"torch=={torch.__version__}"
        )
