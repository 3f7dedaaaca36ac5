"""``lightning-prague``: LightningCLI with the strategies registered, plus ``plan`` and ``bench``.

    lightning-prague fit --config examples/configs/prague_digits.yaml
    lightning-prague plan --workers 8 --step-time 0.05 --sigma 0.5    # predict (core.runtime_model)
    lightning-prague bench --preset quick --out bench-results         # measure against DDP

Any LightningModule/LightningDataModule can be named with ``--model``/``--data`` class paths; the
strategy is ``--trainer.strategy prague`` or a ``class_path``/``init_args`` block in YAML.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

import lightning_prague  # registers the strategies before the Trainer is built

SUBCOMMANDS = """subcommands:
  fit, validate, test, predict   LightningCLI (lightning-prague fit --help for their options)
  plan                           predict which strategy trains fastest on a cluster (plan --help)
  bench                          measure every strategy against DDP (bench --help)

options:
  --version                      print the version and exit
"""


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["--version"]:
        print(f"lightning-prague {lightning_prague.__version__}")
        return
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print(f"usage: lightning-prague {{fit,validate,test,predict,plan,bench}} ... | --version\n\n{SUBCOMMANDS}")
        return
    if argv and argv[0] == "plan":
        from lightning_prague import plan

        plan.main(argv[1:])
        return
    if argv and argv[0] == "bench":
        from lightning_prague import bench

        bench.main(argv[1:])
        return
    LightningCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
