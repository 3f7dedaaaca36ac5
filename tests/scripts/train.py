"""Test driver around lightning_prague.demo.run: adds fault injection and a second fit.

Extra options: --sigterm-rank R --sigterm-batch N (rank R sends itself SIGTERM at its N-th batch),
--refit-epochs E (call trainer.fit again to E epochs), --test (trainer.test after fit).
"""

import argparse
import os
import signal
import sys
import time

import lightning as L
import torch

from lightning_prague.demo import run


class SelfSigterm(L.Callback):
    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch, self.seen = rank, batch, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if trainer.global_rank == self.rank and self.seen == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    extra = argparse.ArgumentParser()
    extra.add_argument("--sigterm-rank", type=int)
    extra.add_argument("--sigterm-batch", type=int, default=3)
    extra.add_argument("--refit-epochs", type=int)
    own, rest = extra.parse_known_args()
    args = run.parse_args(rest)
    callbacks = [SelfSigterm(own.sigterm_rank, own.sigterm_batch)] if own.sigterm_rank is not None else []
    trainer, model, data, summary, checkpoint = run.build(args, callbacks)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    if own.refit_epochs:
        trainer.fit_loop.max_epochs = own.refit_epochs
        trainer.fit(model, datamodule=data)
    result = run.report(args, trainer, model, summary, checkpoint, time.perf_counter() - start)
    if args.test:
        result["test_acc"] = float(trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"])
        if args.json:
            path = args.json if trainer.is_global_zero else args.json.with_suffix(f".rank{trainer.global_rank}.json")
            import json

            path.write_text(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
