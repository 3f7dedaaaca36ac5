"""The registry of private Lightning internals, the check that runs at setup, and the guarded patches.

Every internal the package depends on is in `LIGHTNING_INTERNALS`; the check passes on the
installed Lightning, and for every entry it fails, naming it, when this Lightning lacks it. No
process group is started: these tests build trainers and call the check (or setup) directly.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import lightning
import lightning as L
import pytest
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from lightning_prague import PartialAllReduceStrategy
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.strategies import _patches
from lightning_prague.strategies._checks import (
    LIGHTNING_INTERNALS,
    REPLACED_INTERNALS,
    SUPPORTED_LIGHTNING,
    LightningInternal,
    check_lightning_internals,
    lightning_object,
    locate_owner,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_prague"


def make_trainer(**kwargs: object) -> L.Trainer:
    options: dict[str, object] = {"accelerator": "cpu", "devices": 1, "logger": False}
    options.update(kwargs)
    return L.Trainer(**options)


def remove_from_lightning(internal: LightningInternal, trainer: L.Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the installed Lightning lack `internal` for the rest of the test (as a release that
    renamed it would): off the owner object, off every class of its MRO that defines it, and, for
    attributes that `__init__` sets, off every instance the class builds from now on."""
    if internal.on_instance:
        cls = lightning_object(internal.owner)
        original_init = cls.__init__

        def init_without_it(self: object, *args: object, **kwargs: object) -> None:
            original_init(self, *args, **kwargs)
            if internal.name in vars(self):
                delattr(self, internal.name)

        monkeypatch.setattr(cls, "__init__", init_without_it)
        classes: tuple[type, ...] = cls.__mro__
    else:
        owner = locate_owner(internal, trainer)
        if isinstance(owner, ModuleType):
            monkeypatch.delattr(owner, internal.name)
            return
        if not isinstance(owner, type) and internal.name in vars(owner):
            monkeypatch.delattr(owner, internal.name)
        classes = owner.__mro__ if isinstance(owner, type) else type(owner).__mro__
    for cls in classes:
        if internal.name in vars(cls):
            monkeypatch.delattr(cls, internal.name)


def raised_message(trainer: L.Trainer, strategy_name: str = "prague") -> str:
    with pytest.raises(ConfigurationError) as raised:
        check_lightning_internals(trainer, strategy_name)
    return str(raised.value)


# -- the check on the installed Lightning ---------------------------------------------------------
def test_the_installed_lightning_has_every_registered_internal():
    trainer = make_trainer()
    check_lightning_internals(trainer, "prague")  # raises nothing
    check_lightning_internals(make_trainer(devices=2, strategy=PartialAllReduceStrategy(group_size=2)), "prague")


def test_the_registry_names_each_internal_once_and_each_replaced_method_by_a_unique_name():
    wheres = [internal.where for internal in LIGHTNING_INTERNALS]
    assert len(wheres) == len(set(wheres))
    replaced = [internal.name for internal in REPLACED_INTERNALS]
    assert len(replaced) == len(set(replaced))  # _patches.install looks them up by name
    assert all(internal.purpose for internal in LIGHTNING_INTERNALS)


@pytest.mark.parametrize("internal", LIGHTNING_INTERNALS, ids=[i.where for i in LIGHTNING_INTERNALS])
def test_a_lightning_without_the_internal_is_rejected_naming_it_the_version_and_the_way_out(internal, monkeypatch):
    trainer = make_trainer()
    remove_from_lightning(internal, trainer, monkeypatch)
    message = raised_message(trainer)
    assert internal.where in message
    assert internal.purpose in message
    assert "strategy='prague'" in message
    assert f"lightning=={lightning.__version__}" in message
    assert f"supports lightning{SUPPORTED_LIGHTNING}" in message
    assert f"pip install 'lightning{SUPPORTED_LIGHTNING}'" in message


def test_a_missing_object_on_the_way_names_that_object_and_every_internal_behind_it(monkeypatch):
    trainer = make_trainer()
    monkeypatch.delattr(trainer, "_signal_connector")
    message = raised_message(trainer)
    assert "reached through trainer._signal_connector, which is missing" in message
    behind = [i for i in LIGHTNING_INTERNALS if i.owner == "trainer._signal_connector"]
    assert behind and all(internal.where in message for internal in behind)
    assert "trainer._data_connector" not in message  # only what is missing is named


def test_a_replaced_method_is_looked_for_on_lightnings_class_not_on_our_installed_replacement(monkeypatch):
    trainer = make_trainer()
    _patches.install(trainer, {internal.name: lambda *a: None for internal in REPLACED_INTERNALS})
    loop = trainer.fit_loop.epoch_loop
    assert "_broadcast_sigterm_tensor" in vars(loop)  # ours shadows Lightning's
    monkeypatch.delattr(type(loop), "_broadcast_sigterm_tensor")
    assert "trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor" in raised_message(trainer)
    _patches.remove(trainer)


# -- the strategy runs the check at setup, before anything is patched -------------------------------
def test_setup_of_a_fit_rejects_an_unsupported_lightning_before_anything_is_patched(monkeypatch):
    strategy = PartialAllReduceStrategy(group_size=2)
    trainer = make_trainer(devices=2, strategy=strategy)
    trainer.state.fn = TrainerFn.FITTING
    (sigterm,) = [i for i in REPLACED_INTERNALS if i.name == "_broadcast_sigterm_tensor"]
    remove_from_lightning(sigterm, trainer, monkeypatch)
    with pytest.raises(
        ConfigurationError, match=r"strategy='prague' .*fit_loop\.epoch_loop\._broadcast_sigterm_tensor"
    ):
        strategy.setup(trainer)
    assert strategy.training is None and strategy.progress is None
    for internal in REPLACED_INTERNALS:
        assert internal.name not in vars(locate_owner(internal, trainer))


# -- _patches.install refuses to shadow what Lightning does not have ------------------------------
def test_install_shadows_every_replaced_method_and_remove_takes_them_off_again():
    trainer = make_trainer()
    replacements = {internal.name: (lambda *a: None) for internal in REPLACED_INTERNALS}
    _patches.install(trainer, replacements, "prague")
    for internal in REPLACED_INTERNALS:
        assert vars(locate_owner(internal, trainer))[internal.name] is replacements[internal.name]
    _patches.remove(trainer)
    for internal in REPLACED_INTERNALS:
        assert internal.name not in vars(locate_owner(internal, trainer))


def test_install_refuses_to_shadow_a_method_lightning_lacks_and_installs_nothing(monkeypatch):
    trainer = make_trainer()
    loop = trainer.fit_loop.epoch_loop
    monkeypatch.delattr(type(loop), "_broadcast_sigterm_tensor")
    with pytest.raises(ConfigurationError) as raised:
        _patches.install(
            trainer, {"_update_learning_rates": lambda *a: None, "_broadcast_sigterm_tensor": lambda: None}, "prague"
        )
    message = str(raised.value)
    assert "strategy='prague'" in message
    assert "trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor" in message
    assert f"lightning=={lightning.__version__}" in message and f"lightning{SUPPORTED_LIGHTNING}" in message
    assert "_update_learning_rates" not in vars(loop)  # all or nothing
    assert "_broadcast_sigterm_tensor" not in vars(loop)


def test_install_rejects_a_replacement_for_an_unregistered_method():
    trainer = make_trainer()
    with pytest.raises(ValueError, match=r"\['_not_a_lightning_method'\].*LIGHTNING_INTERNALS"):
        _patches.install(trainer, {"_not_a_lightning_method": lambda: None})
    assert "_not_a_lightning_method" not in vars(trainer.fit_loop.epoch_loop)


# -- the supported range ------------------------------------------------------------------------
def test_the_supported_range_is_pyprojects_and_holds_the_installed_lightning():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (declared,) = [Requirement(d) for d in dependencies if Requirement(d).name == "lightning"]
    assert declared.specifier == SpecifierSet(SUPPORTED_LIGHTNING)
    assert lightning.__version__ in SpecifierSet(SUPPORTED_LIGHTNING)


# -- the registry is complete: the package's sources touch no private Lightning name outside it -----
#: variables that hold Lightning's trainer, loops or callbacks in the package's sources
LIGHTNING_HOLDERS = {
    "trainer",
    "_trainer",
    "fit_loop",
    "epoch_loop",
    "val_loop",
    "loop",
    "callback",
    "cb",
    "_data_connector",
    "_signal_connector",
}


#: names that hold our strategy in the strategies' sources: the strategy itself (`self`) and the
#: parts it delegates to (`self.strategy`, `strategy`), where `x._name` means Lightning's `_name`
STRATEGY_HOLDERS = {"self", "strategy"}


def registered_names() -> set[str]:
    """Every registered internal's name and every private object on the way to one."""
    names = {internal.name for internal in LIGHTNING_INTERNALS}
    for internal in LIGHTNING_INTERNALS:
        names.update(internal.owner.removesuffix("()").replace(":", ".").split("."))
    return names


def lightning_private_names() -> set[str]:
    """Private names that Lightning's strategy and script launcher have: `self._x` or `def _x` in our
    subclasses of them means Lightning's `_x`."""
    launcher = _SubprocessScriptLauncher(LightningEnvironment(), 1, 1)
    candidates = set(dir(DDPStrategy())) | set(dir(launcher))
    return {name for name in candidates if name.startswith("_") and not name.startswith("__")}


def private_lightning_uses(tree: ast.AST, lightning_names: set[str], in_strategies: bool) -> Iterator[tuple[int, str]]:
    """(line, name) of every private Lightning name a module's syntax tree touches."""
    lightning_modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            for alias in node.names:
                lightning_modules.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.Import):
            lightning_modules.update(a.asname or a.name for a in node.names if a.name.split(".")[0] == "lightning")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and in_strategies and node.name in lightning_names:
            yield node.lineno, node.name  # overrides Lightning's
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        receiver = node.value
        held = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
        calls_super = isinstance(receiver, ast.Call) and getattr(receiver.func, "id", None) == "super"
        if held in LIGHTNING_HOLDERS or held in lightning_modules or calls_super:
            yield node.lineno, node.attr
        elif in_strategies and held in STRATEGY_HOLDERS and node.attr in lightning_names:
            yield node.lineno, node.attr


def test_every_private_lightning_name_the_package_touches_is_registered():
    lightning_names = lightning_private_names()
    registered = registered_names()
    unregistered = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        in_strategies = path.parent.name == "strategies"
        for line, name in private_lightning_uses(tree, lightning_names, in_strategies):
            if name not in registered:
                unregistered.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not unregistered, "add these to LIGHTNING_INTERNALS (lightning_prague/strategies/_checks.py)"


def test_the_scan_sees_lightnings_names_on_the_strategy_and_through_the_parts_it_delegates_to():
    source = "def hook(self, strategy):\n    return self._timeout, self.strategy._launcher, strategy._start_method\n"
    uses = private_lightning_uses(ast.parse(source), lightning_private_names(), in_strategies=True)
    assert {name for _, name in uses} == {"_timeout", "_launcher", "_start_method"}
