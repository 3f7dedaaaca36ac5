"""Which samples each rank trained, for the exactly-once tests: `SampleRecorder`.

At the end of every training batch (after its optimizer step: the batch counts as trained) a rank
appends one line per sample to `samples.rankR.jsonl`: the epoch and a digest of the sample's input,
flushed at once, so that what a rank killed later trained is on disk. The test compares the digests
an epoch trained over all ranks with the training set's, as multisets (a sample that occurs twice in
the data must be trained twice).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning as L


def digest(row) -> str:
    return hashlib.sha1(row.contiguous().numpy().tobytes()).hexdigest()[:16]


class SampleRecorder(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._file = None

    def on_train_start(self, trainer, pl_module):
        self._file = open(self.directory / f"samples.rank{trainer.global_rank}.jsonl", "a", buffering=1)
        if trainer.global_rank == 0:
            rows = trainer.datamodule.train_set.tensors[0]
            (self.directory / "dataset.json").write_text(json.dumps([digest(r) for r in rows]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        x = batch[0].detach().cpu()
        line = json.dumps({"epoch": trainer.current_epoch, "samples": [digest(r) for r in x]})
        self._file.write(line + "\n")

    def on_train_end(self, trainer, pl_module):
        if self._file is not None:
            self._file.close()
