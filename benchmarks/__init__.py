"""gpushare benchmarks: one entry point (``python -m benchmarks``), results under ``results/``."""
