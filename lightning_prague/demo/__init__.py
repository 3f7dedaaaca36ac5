"""Small, download-free workloads for the demos, tests and benchmarks.

Digits classification (scikit-learn's bundled digits) and a character-level Transformer language
model on CPython's own help text (`pydoc_data`); synthetic datasets indexed by sample
(`lightning_prague.demo.synthetic`).
"""

from lightning_prague.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_prague.demo.synthetic import IndexedSamples, RankStream
from lightning_prague.demo.textlm import PythonHelpText, TinyTransformerLM

__all__ = [
    "DigitsClassifier",
    "DigitsDataModule",
    "IndexedSamples",
    "PythonHelpText",
    "RankStream",
    "TinyTransformerLM",
]
