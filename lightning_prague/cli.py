"""`lightning-prague`: LightningCLI with the strategies registered, plus `plan` and `bench`.

    lightning-prague fit --config examples/configs/prague_digits.yaml
    lightning-prague plan --workers 8 --step-time 0.05 --sigma 0.5    # predict (lightning_prague.tools.runtime_model)
    lightning-prague bench --preset quick --out bench-results         # measure against DDP
    lightning-prague consolidate checkpoints/last.ckpt                # one file from a sharded checkpoint

Any LightningModule/LightningDataModule can be named with `--model`/`--data` class paths. The
strategy is `--trainer.strategy prague` or a `class_path`/`init_args` block in YAML, and the
registered names of this package's strategies (`prague`, `partial_all_reduce`, `partial_reduce`,
`adpsgd`, `decent_adam`) work wherever a class path is expected, so a strategy selected by name
takes option overrides:

    lightning-prague fit --config examples/configs/prague_by_name.yaml --trainer.strategy.group_size 2
    lightning-prague fit --config examples/configs/prague_digits.yaml --trainer.strategy.class_path partial_reduce
    lightning-prague fit ... --trainer.strategy prague --trainer.strategy.grouping buffer

Lightning's own strategy names (`ddp`, `fsdp`, ...) stay plain strings; to override their options
select them by class path (`--trainer.strategy.class_path lightning.pytorch.strategies.DDPStrategy`).
"""

from __future__ import annotations

import copy
import sys
from typing import Any, NoReturn, Optional

from jsonargparse import Namespace
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_prague  # registers the strategies before the Trainer is built
from lightning_prague.cli_names import PARSER_MODE, lightning_name_hint, rewrite_config, rewrite_strategy_args

SUBCOMMANDS = """subcommands:
  fit, validate, test, predict   LightningCLI (lightning-prague fit --help for their options)
  plan                           predict which strategy trains fastest on a cluster (plan --help)
  bench                          measure every strategy against DDP (bench --help)
  plane                          serve a job's store and control plane on this host (plane --help)
  consolidate                    one whole checkpoint file from one saved shard by shard (consolidate --help)

options:
  --version                      print the version and exit

examples:
  lightning-prague fit --config examples/configs/prague_digits.yaml
  lightning-prague fit --config examples/configs/prague_by_name.yaml --trainer.strategy.group_size 2
  lightning-prague fit --trainer.strategy.help prague     # the options of a strategy (any registered name)
"""


class PragueArgumentParser(LightningArgumentParser):
    """`LightningArgumentParser` whose errors say how to override options of Lightning's strategy names."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        hint = lightning_name_hint(message)
        super().error(message if hint is None else f"{message}\n{hint}", ex)


class PragueCLI(LightningCLI):
    """`LightningCLI` in which this package's strategy names work wherever a class path is expected.

    Config files (`strategy: prague`, `class_path: partial_reduce`) are rewritten as they are
    loaded, and the command line before it is parsed (`rewrite_strategy_args`), so options of a
    strategy selected by name can be overridden (`--trainer.strategy.group_size 2`). Lightning's
    own names stay strings; overriding their options fails with a message giving the class path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", PragueArgumentParser)
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("parser_mode", PARSER_MODE)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if args is None:
            self.config = parser.parse_args(rewrite_strategy_args(sys.argv[1:]))
            return
        if isinstance(args, dict):
            args = rewrite_config(copy.deepcopy(args))
        elif not isinstance(args, Namespace):
            args = rewrite_strategy_args(list(args))
        super().parse_arguments(parser, args)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["--version"]:
        print(f"lightning-prague {lightning_prague.__version__}")
        return
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        commands = "fit,validate,test,predict,plan,bench,plane,consolidate"
        print(f"usage: lightning-prague {{{commands}}} ... | --version\n\n{SUBCOMMANDS}")
        return
    if argv and argv[0] == "plan":
        from lightning_prague.tools import plan

        plan.main(argv[1:])
        return
    if argv and argv[0] == "plane":
        from lightning_prague.core.plane import service

        service.main(argv[1:])
        return
    if argv and argv[0] == "consolidate":
        from lightning_prague.tools import consolidate

        consolidate.main(argv[1:])
        return
    if argv and argv[0] == "bench":
        from lightning_prague.tools import bench

        bench.main(argv[1:])
        return
    PragueCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
