"""``lightning-prague``: LightningCLI with the strategies registered.

    lightning-prague fit --config examples/configs/prague_digits.yaml

Any LightningModule/LightningDataModule can be named with ``--model``/``--data`` class paths; the
strategy is ``--trainer.strategy prague`` or a ``class_path``/``init_args`` block in YAML.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_prague  # noqa: F401  (registers the strategies before the Trainer is built)


def main(args: list[str] | None = None) -> None:
    LightningCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
