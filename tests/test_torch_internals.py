"""The registry of private torch.distributed internals and the check `init_job` runs before using them.

Every private part of `torch.distributed.distributed_c10d` the package uses is in `TORCH_INTERNALS`;
the check passes on the installed torch, and for every entry it fails, naming it and the installed
version, when this torch lacks it. No process group is started.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from lightning_prague.core import job
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.job import SUPPORTED_TORCH, TORCH_INTERNALS, TorchInternal, check_torch_internals

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_prague"
#: `distributed_c10d.NAME` or `c10d.NAME` (job.py's alias), and `_world.FIELD` after it
USE = re.compile(r"\b(?:distributed_c10d|c10d)\.(\w+)(?:\.(\w+))?")


def remove_from_torch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the installed torch lack `name` (a path in distributed_c10d) for the rest of the test, as
    a release that renamed it would: off its owner, or off the class of the owner that defines it."""
    *path, last = name.split(".")
    owner: object = dist.distributed_c10d
    for part in path:
        owner = getattr(owner, part)
    if last not in vars(owner):
        owner = next(cls for cls in type(owner).__mro__ if last in vars(cls))
    monkeypatch.delattr(owner, last)


def test_the_installed_torch_has_every_internal():
    check_torch_internals()


@pytest.mark.parametrize("internal", TORCH_INTERNALS, ids=lambda i: i.name)
def test_a_missing_internal_is_named_with_the_installed_torch(internal: TorchInternal, monkeypatch):
    remove_from_torch(internal.name, monkeypatch)
    with pytest.raises(ConfigurationError) as caught:
        check_torch_internals()
    message = str(caught.value)
    assert internal.where in message
    assert f"torch=={torch.__version__}" in message
    assert f"torch{SUPPORTED_TORCH}" in message


def test_the_registry_of_process_groups_missing_is_named(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_world")
    with pytest.raises(ConfigurationError, match=r"torch\.distributed\.distributed_c10d\._world \("):
        check_torch_internals()


@pytest.mark.parametrize("name", [i.name for i in TORCH_INTERNALS if i.called])
def test_an_internal_that_is_no_longer_callable_is_named(name: str, monkeypatch):
    monkeypatch.setattr(dist.distributed_c10d, name, object())
    with pytest.raises(ConfigurationError, match=rf"distributed_c10d\.{name} \(.*\) is not callable"):
        check_torch_internals()


def test_an_internal_that_no_longer_takes_its_arguments_is_named(monkeypatch):
    def helper(group_size, group_rank, global_ranks_in_group, backend, store, group_name, timeout=None):
        raise AssertionError("never called")

    monkeypatch.setattr(dist.distributed_c10d, "_new_process_group_helper", helper)
    with pytest.raises(ConfigurationError, match=r"_new_process_group_helper \(.*\) does not take .*device_id="):
        check_torch_internals()


def test_init_job_checks_before_anything_else(monkeypatch):
    assert job.current_job() is None
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # anything past the check would fail on it instead
    monkeypatch.setattr(job, "launch", lambda *a, **k: pytest.fail("the supervisor was started"))
    remove_from_torch("_set_pg_timeout", monkeypatch)
    with pytest.raises(ConfigurationError, match=r"distributed_c10d\._set_pg_timeout"):
        job.init_job(0, 2, "gloo", timeout=5)


def test_every_private_internal_the_package_uses_is_registered():
    registered = {i.name for i in TORCH_INTERNALS}
    used: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for first, second in USE.findall(path.read_text()):
            if first.startswith("_"):
                name = f"{first}.{second}" if first == "_world" and second else first
                used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert used, "the scan found no use of distributed_c10d"
    unregistered = {name: sorted(files) for name, files in used.items() if name not in registered}
    assert not unregistered, f"private torch internals used but not in TORCH_INTERNALS: {unregistered}"


def test_the_supported_torch_is_the_dependency_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_requirements = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    assert [r.specifier for r in torch_requirements] == [SpecifierSet(SUPPORTED_TORCH)]
