"""The paired benchmark's confidence interval for a median (benchmarks/train_bench.py)."""

import importlib.util
import random
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "train_bench", Path(__file__).parents[1] / "benchmarks" / "train_bench.py")
train_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_bench)


def test_median_ci_matches_the_sign_test_table():
    # 95% ranks (1-based) from the binomial table: n=10 -> 2nd and 9th, n=100 -> 40th and 61st
    assert train_bench.median_ci(list(range(1, 11))) == (2, 9)
    assert train_bench.median_ci(list(range(1, 101))) == (40, 61)
    assert train_bench.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few rounds: the range


def test_median_ci_covers_the_median_about_95_percent():
    rng = random.Random(0)
    hits = sum(lo <= 0.0 <= hi for lo, hi in
               (train_bench.median_ci([rng.gauss(0, 1) for _ in range(40)]) for _ in range(1000)))
    assert 0.94 <= hits / 1000 <= 0.99  # exact binomial ranks: coverage >= 95%
