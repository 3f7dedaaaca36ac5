"""The `lightning-prague` command line: parsing only (no training, no process group).

`PragueCLI(run=False, ...)` parses and builds the Trainer and the strategy in this process; the
strategies reject unusable settings only at setup, which is never reached here.
"""

import inspect
import json
import sys
from typing import get_args

import pytest
from helpers import ROOT
from lightning.pytorch.strategies import DDPStrategy

import lightning_prague
from lightning_prague import (
    ADPSGDStrategy,
    ConfigurationError,
    DecentAdamStrategy,
    DecentralizedStrategy,
    PartialAllReduceStrategy,
    PartialReduceStrategy,
)
from lightning_prague.cli import PragueCLI, main
from lightning_prague.cli_names import rewrite_config, rewrite_strategy_args, strategy_spec
from lightning_prague.core.grouping.policies import WEIGHTINGS
from lightning_prague.core.grouping.topology import TOPOLOGIES
from lightning_prague.strategies import STRATEGIES
from lightning_prague.strategies.decent_adam import Topology
from lightning_prague.strategies.partial_all_reduce import PRAGUE_POLICIES, Grouping
from lightning_prague.strategies.partial_reduce import Weighting

CONFIGS = ROOT / "examples" / "configs"
BY_NAME = ["--config", str(CONFIGS / "prague_by_name.yaml")]


@pytest.fixture(autouse=True)
def _no_argv(monkeypatch):
    """LightningCLI warns when both `args` and `sys.argv` (pytest's here) hold arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-prague"])


def parse(*args: str) -> PragueCLI:
    return PragueCLI(run=False, args=[*args, "--trainer.devices", "2", "--seed_everything", "0"])


def parse_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(*args)
    assert exit_info.value.code != 0
    return capsys.readouterr().err


# -- the rewriting of our strategy names ------------------------------------------------------
def test_registered_names_become_class_paths_on_the_command_line():
    argv = ["fit", "--trainer.strategy", "prague", "--trainer.strategy.group_size", "2"]
    assert rewrite_strategy_args(argv) == [
        "fit",
        "--trainer.strategy",
        json.dumps({"class_path": "lightning_prague.PartialAllReduceStrategy"}),
        "--trainer.strategy.group_size",
        "2",
    ]
    assert rewrite_strategy_args(["--trainer.strategy.class_path=partial_reduce"]) == [
        "--trainer.strategy.class_path=lightning_prague.PartialReduceStrategy"
    ]
    assert rewrite_strategy_args(["--trainer.strategy.help", "decent_adam"]) == [
        "--trainer.strategy.help",
        "lightning_prague.DecentAdamStrategy",
    ]
    # Lightning's names, other options and anything after "--" are left alone
    untouched = ["--trainer.strategy=ddp", "--model.name", "prague", "--trainer.strategy", "auto", "--", "prague"]
    assert rewrite_strategy_args(untouched) == untouched


def test_strategy_values_of_config_files():
    for name, (cls, _) in STRATEGIES.items():
        assert strategy_spec(name) == {"class_path": f"lightning_prague.{cls.__name__}"}
    assert strategy_spec("ddp") == "ddp" and strategy_spec("auto") == "auto"
    # a class path string would reach the Trainer as a strategy *name*
    assert strategy_spec("lightning_prague.ADPSGDStrategy") == {"class_path": "lightning_prague.ADPSGDStrategy"}
    spec = {"class_path": "adpsgd", "init_args": {"sync_every": 2}}
    assert strategy_spec(spec) == {"class_path": "lightning_prague.ADPSGDStrategy", "init_args": {"sync_every": 2}}
    config = {"fit": {"trainer": {"strategy": "partial_reduce", "devices": 4}}, "model": "prague"}
    assert rewrite_config(config) == {
        "fit": {"trainer": {"strategy": {"class_path": "lightning_prague.PartialReduceStrategy"}, "devices": 4}},
        "model": "prague",
    }
    assert rewrite_config({"trainer": {"strategy": "ddp"}}) == {"trainer": {"strategy": "ddp"}}


# -- overriding options of a strategy selected by name ----------------------------------------
def test_yaml_name_then_command_line_option():
    strategy = parse(*BY_NAME, "--trainer.strategy.group_size", "2").trainer.strategy
    assert type(strategy) is PartialAllReduceStrategy and strategy.group_size == 2


def test_yaml_name_alone_is_the_strategy_with_its_defaults():
    cli = parse(*BY_NAME)
    assert type(cli.trainer.strategy) is PartialAllReduceStrategy and cli.trainer.strategy.group_size == 3
    assert cli.config.trainer.strategy.class_path == "lightning_prague.PartialAllReduceStrategy"


def test_class_path_by_registered_name_keeps_the_options_the_new_class_accepts():
    config = ["--config", str(CONFIGS / "prague_digits.yaml")]
    args = ["--trainer.strategy.class_path", "partial_reduce", "--trainer.strategy.weighting", "staleness"]
    strategy = parse(*config, *args).trainer.strategy
    assert type(strategy) is PartialReduceStrategy
    assert strategy.weighting == "staleness" and strategy.group_size == 3


def test_command_line_name_then_option():
    args = [
        "--trainer.strategy",
        "prague",
        "--trainer.strategy.group_size",
        "2",
        "--trainer.strategy.grouping",
        "buffer",
    ]
    strategy = parse(*BY_NAME, *args).trainer.strategy
    assert type(strategy) is PartialAllReduceStrategy
    assert (strategy.group_size, strategy.grouping) == (2, "buffer")


def test_command_line_class_path_then_option():
    args = ["--trainer.strategy", "lightning_prague.DecentAdamStrategy", "--trainer.strategy.topology", "complete"]
    strategy = parse(*BY_NAME, *args).trainer.strategy
    assert type(strategy) is DecentAdamStrategy and strategy.topology == "complete"


def test_yaml_class_path_by_registered_name(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: adpsgd\n    init_args:\n      sync_every: 2\n"
        "model:\n  class_path: lightning_prague.demo.DigitsClassifier\n"
        "data:\n  class_path: lightning_prague.demo.DigitsDataModule\n"
    )
    strategy = parse("--config", str(config), "--trainer.strategy.seed", "7").trainer.strategy
    assert type(strategy) is ADPSGDStrategy and (strategy.sync_every, strategy.seed) == (2, 7)


def test_lightning_strategy_names_stay_strings():
    cli = parse(*BY_NAME, "--trainer.strategy", "ddp")
    assert cli.config.trainer.strategy == "ddp" and type(cli.trainer.strategy) is DDPStrategy


def test_overriding_options_of_a_lightning_name_says_how(capsys):
    args = ["--trainer.strategy", "ddp_spawn", "--trainer.strategy.find_unused_parameters", "true"]
    error = parse_error(capsys, *BY_NAME, *args)
    class_path = "--trainer.strategy.class_path lightning.pytorch.strategies.ddp.DDPStrategy"
    assert f"{class_path} --trainer.strategy.start_method spawn" in error, error


# -- choices ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, option, choices",
    [
        ("prague", "grouping", get_args(Grouping)),
        ("partial_reduce", "weighting", get_args(Weighting)),
        ("decent_adam", "topology", get_args(Topology)),
    ],
)
def test_enumerated_options_reject_a_bad_value_listing_the_choices(capsys, name, option, choices):
    error = parse_error(capsys, *BY_NAME, "--trainer.strategy", name, f"--trainer.strategy.{option}", "bogus")
    assert "bogus" in error
    assert all(repr(choice) in error for choice in choices), error


def test_choices_are_single_sourced_and_python_users_get_configuration_errors():
    assert PRAGUE_POLICIES == get_args(Grouping)
    assert get_args(Weighting) == WEIGHTINGS
    assert get_args(Topology) == TOPOLOGIES
    with pytest.raises(ConfigurationError, match="buffer"):
        PartialAllReduceStrategy(grouping="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="staleness"):
        PartialReduceStrategy(weighting="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="one_peer_exp"):
        DecentAdamStrategy(topology="bogus")  # type: ignore[arg-type]
    # a custom schedule replaces the named topology
    assert DecentAdamStrategy(schedule=[[[0, 1]]]).schedule_spec == [[[0, 1]]]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_strategy_help_is_clean_and_shows_choices(capsys, name):
    with pytest.raises(SystemExit) as exit_info:
        PragueCLI(run=False, args=["--trainer.strategy.help", name])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"Help for --trainer.strategy.help=lightning_prague.{STRATEGIES[name][0].__name__}" in text
    assert "``" not in text and ":class:" not in text and ":mod:" not in text
    assert "--trainer.strategy.sync_every" in text  # the shared options, from the base class
    if name in ("prague", "partial_all_reduce"):
        assert "{random,buffer,division,static}" in text
    if name == "decent_adam":
        assert "{complete,ring,one_peer_exp,alternating_exp_ring,static}" in text


# -- the abstract base class ------------------------------------------------------------------
def test_the_abstract_base_class_is_not_offered(capsys):
    with pytest.raises(SystemExit):
        PragueCLI(run=False, args=["--help"])
    text = capsys.readouterr().out
    for cls, _ in STRATEGIES.values():
        assert f"lightning_prague.{cls.__name__}" in text
    assert "DecentralizedStrategy" not in text
    assert inspect.isabstract(DecentralizedStrategy)
    assert not any(inspect.isabstract(cls) for cls, _ in STRATEGIES.values())
    with pytest.raises(TypeError, match="abstract"):
        DecentralizedStrategy()  # type: ignore[abstract]


def test_selecting_the_abstract_base_class_fails_up_front(capsys):
    error = parse_error(capsys, *BY_NAME, "--trainer.strategy.class_path", "lightning_prague.DecentralizedStrategy")
    assert "abstract" in error


# -- the example configs and the entry point ---------------------------------------------------
@pytest.mark.parametrize("config", sorted(path.name for path in CONFIGS.glob("*.yaml")))
def test_example_configs_parse(config):
    cli = parse("--config", str(CONFIGS / config))
    assert isinstance(cli.trainer.strategy, DecentralizedStrategy)
    graph = getattr(cli.trainer.strategy, "graph_spec", None)
    assert graph is None  # no config assumes a number of workers


def test_a_printed_config_parses_again_and_holds_no_removed_option(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        parse("--config", str(CONFIGS / "prague_digits.yaml"), "--print_config")
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "sync_every:" in printed and "max_groups" not in printed
    saved = tmp_path / "saved.yaml"
    saved.write_text(printed)
    assert isinstance(parse("--config", str(saved)).trainer.strategy, PartialAllReduceStrategy)


def test_help_lists_every_subcommand_and_version(capsys):
    main(["--help"])
    text = capsys.readouterr().out
    for word in ("fit", "validate", "test", "predict", "plan", "bench", "--version", "--trainer.strategy.help"):
        assert word in text
    main(["--version"])
    assert capsys.readouterr().out.strip() == f"lightning-prague {lightning_prague.__version__}"
