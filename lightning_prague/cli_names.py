"""Our strategy names wherever LightningCLI expects a class path.

LightningCLI hands a plain string `trainer.strategy` to the Trainer as a strategy *name*, which
takes no option overrides. These functions turn this package's registered names (`prague`,
`partial_reduce`, ...) and class names into `class_path` specs, in config files as they are
loaded (a jsonargparse loader, `PARSER_MODE`) and on the command line before it is parsed, so
`--trainer.strategy prague --trainer.strategy.group_size 2` works. Lightning's own names stay
strings; `lightning_name_hint` says how to override their options.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from typing import Any, Optional

import yaml
from jsonargparse import get_loader, set_loader
from lightning.pytorch.strategies import Strategy, StrategyRegistry

import lightning_prague
from lightning_prague.strategies import STRATEGIES

#: jsonargparse parser mode of `PragueCLI`: YAML, with our strategy names made class paths
PARSER_MODE = "lightning_prague_yaml"
#: command-line options whose value may be one of our strategy names
STRATEGY_OPTION = "--trainer.strategy"
CLASS_PATH_OPTIONS = ("--trainer.strategy.class_path", "--trainer.strategy.help")
#: the LightningCLI subcommands a root-level config file may have sections for
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def _public_path(cls: type) -> str:
    """`lightning_prague.Name` where the package exports the class, else its module path."""
    if getattr(lightning_prague, cls.__name__, None) is cls:
        return f"lightning_prague.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def strategy_class_path(name: str) -> Optional[str]:
    """The class path of this package's strategy registered as (or named) `name`; `None` for any other name.

    Registered names (`prague`, `partial_reduce`, ...) and class names (`PartialReduceStrategy`)
    are recognised; anything else (Lightning's `ddp`, a class path) gives `None`.
    """
    entry = STRATEGIES.get(name)
    if entry is not None:
        return _public_path(entry[0])
    for cls, _ in STRATEGIES.values():
        if name == cls.__name__:
            return _public_path(cls)
    return None


def _is_strategy_class_path(value: str) -> bool:
    """Whether `value` is an import path (`a.b.Class`) of a Lightning `Strategy` subclass."""
    if "." not in value or os.sep in value or " " in value or os.path.exists(value):
        return False  # a config file, not a class path
    module, _, name = value.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except Exception:  # not importable: leave the value to jsonargparse and Lightning
        return False
    return isinstance(obj, type) and issubclass(obj, Strategy)


def strategy_spec(value: Any) -> Any:
    """A `trainer.strategy` value with this package's strategy names made class paths.

    * `"prague"` (or another registered name, or a class name of ours) becomes
      `{"class_path": "lightning_prague.PartialAllReduceStrategy"}`, which jsonargparse merges
      option overrides into (a plain string takes none);
    * a class path string (`"lightning_prague.PartialReduceStrategy"`) becomes `{"class_path": ...}`
      as well: as a plain string LightningCLI would hand it to the Trainer as a strategy *name*;
    * `{"class_path": "prague", "init_args": {...}}` gets the class path of `prague`.

    Anything else, such as Lightning's own names (`"ddp"`, `"auto"`), is returned unchanged.
    """
    if isinstance(value, str):
        class_path = strategy_class_path(value)
        if class_path is None and _is_strategy_class_path(value):
            class_path = value
        return value if class_path is None else {"class_path": class_path}
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        class_path = strategy_class_path(value["class_path"])
        if class_path is not None:
            return {**value, "class_path": class_path}
    return value


def rewrite_config(config: Any) -> Any:
    """A loaded config document with `trainer.strategy` passed through `strategy_spec`.

    Handles a subcommand's config (`trainer: {strategy: prague}`), a root config with subcommand
    sections (`fit: {trainer: ...}`) and a strategy spec of its own (`{class_path: prague}`, as
    `--trainer.strategy strategy.yaml` loads). Other documents and values are returned unchanged.
    """
    if not isinstance(config, dict):
        return config
    if "class_path" in config:
        return strategy_spec(config)
    trainer = config.get("trainer")
    if isinstance(trainer, dict) and "strategy" in trainer:
        config["trainer"] = {**trainer, "strategy": strategy_spec(trainer["strategy"])}
    for subcommand in LIGHTNING_SUBCOMMANDS:
        if isinstance(config.get(subcommand), dict):
            config[subcommand] = rewrite_config(config[subcommand])
    return config


def rewrite_strategy_args(argv: list[str]) -> list[str]:
    """Command-line arguments with this package's strategy names made class paths.

    `--trainer.strategy NAME` (or `=NAME`) becomes `--trainer.strategy {"class_path": ...}`
    (see `strategy_spec`); `--trainer.strategy.class_path NAME` and `--trainer.strategy.help NAME`
    get the class path. Config files are rewritten as they are loaded (`rewrite_config`).
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        option, equals, value = arg.partition("=")
        if option != STRATEGY_OPTION and option not in CLASS_PATH_OPTIONS:
            out.append(arg)
        elif equals:
            out.append(f"{option}={_rewrite_value(option, value)}")
        elif i + 1 < len(argv):
            out += [option, _rewrite_value(option, argv[i + 1])]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def _rewrite_value(option: str, value: str) -> str:
    if option == STRATEGY_OPTION:
        spec = strategy_spec(value)
        return value if isinstance(spec, str) else json.dumps(spec)
    return strategy_class_path(value) or value


def _load(text: str) -> Any:
    return rewrite_config(get_loader("yaml")(text))


set_loader(PARSER_MODE, _load, exceptions=(yaml.YAMLError,))


_NOT_A_CLASS_PATH = re.compile(r"Expected a dot import path string: ([\w.-]+)")


def lightning_name_hint(message: str) -> Optional[str]:
    """How to override options of a strategy given by a Lightning name, when `message` is that error."""
    for name in _NOT_A_CLASS_PATH.findall(message):
        if name not in StrategyRegistry or strategy_class_path(name) is not None:
            continue
        entry = StrategyRegistry[name]  # (its get() builds the strategy)
        cls = entry["strategy"]
        options = "".join(
            f" --trainer.strategy.{key} {value if isinstance(value, str) else json.dumps(value)}"
            for key, value in entry["init_params"].items()
        )
        return (
            f"{name!r} is a strategy name of Lightning's, which takes no option overrides; select the strategy "
            f"by class path instead: --trainer.strategy.class_path {cls.__module__}.{cls.__qualname__}{options} "
            "(or class_path/init_args in the config file)"
        )
    return None
