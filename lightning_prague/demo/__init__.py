"""A small, download-free workload (scikit-learn's bundled digits) for the demo, tests and benchmarks."""

from lightning_prague.demo.digits import DigitsClassifier, DigitsDataModule

__all__ = ["DigitsClassifier", "DigitsDataModule"]
