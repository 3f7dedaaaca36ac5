"""The documentation and the code in step, where a machine can check it: every option of every
strategy is described in its reference (the docstrings the API pages render), every example config
names only options that exist and says what it claims, and every error class the troubleshooting
page names exists."""

from __future__ import annotations

import builtins
import inspect
import re
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

import lightning_prague
from lightning_prague.core import errors
from lightning_prague.strategies.base import DecentralizedStrategy

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = [
    lightning_prague.PartialAllReduceStrategy,
    lightning_prague.PartialReduceStrategy,
    lightning_prague.ADPSGDStrategy,
    lightning_prague.DecentAdamStrategy,
]
#: arguments of DecentralizedStrategy that are Lightning's own DDPStrategy plugins (documented as such)
LIGHTNING_PLUGINS = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "start_method",
}


def options(cls: type) -> list[str]:
    """The keyword options `cls.__init__` declares itself (not `*args`, `**kwargs`)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def reference(cls: type) -> str:
    return (cls.__doc__ or "") + (cls.__init__.__doc__ or "")


@pytest.mark.parametrize("cls", [DecentralizedStrategy, *STRATEGIES], ids=lambda c: c.__name__)
def test_every_option_of_every_strategy_is_described_in_its_reference(cls):
    text = reference(cls)
    for name in options(cls):
        if name in LIGHTNING_PLUGINS:
            continue
        assert re.search(rf"`?{name}`?\s*[:(]", text) or f"`{name}`" in text, f"{cls.__name__}: {name} undocumented"
    assert "ddp_kwargs" not in options(cls) or "DDPStrategy" in reference(DecentralizedStrategy)


CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_names_only_options_that_exist(path):
    config = yaml.safe_load(path.read_text())
    strategy = config["trainer"]["strategy"]
    if isinstance(strategy, str):  # a registered name
        assert strategy in StrategyRegistry, f"{path.name}: {strategy} is not a registered strategy"
        return
    module, _, name = strategy["class_path"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    accepted = set(options(cls)) | set(options(DecentralizedStrategy))
    given = set(strategy.get("init_args", {}))
    assert given <= accepted, f"{path.name}: unknown options {sorted(given - accepted)} of {cls.__name__}"
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    if "every option" in header:  # the claim holds: every option of the strategy's own is spelled out
        own = options(cls)
        assert set(own) <= given, f"{path.name} claims every option but omits {sorted(set(own) - given)}"


def test_every_error_class_the_troubleshooting_page_names_exists():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    named = set(
        re.findall(r"`(?:lightning_prague\.)?([A-Z][A-Za-z]+(?:Error|Timeout|Lost|Failure|Interrupted))`", text)
    )
    assert named, "the page names error classes"
    for name in sorted(named):
        exists = hasattr(errors, name) or hasattr(lightning_prague, name) or hasattr(builtins, name)
        assert exists, f"troubleshooting.md names {name}, which does not exist"
