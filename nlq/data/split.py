"""The split of a corpus by document into train (0), val (1) and test (2).

Val and test are chosen by document, seeded: a source held in memory gets exactly
max(1, round(f * n_docs)) documents of each, val drawn with numpy's default_rng(seed) (as
before the test split existed, so val stays the same documents) and test from the rest with
default_rng([seed, 2]); a streamed source of unknown length sends document i to val when a
counter-seeded uniform u(seed, i) < f_val and to test when f_val <= u < f_val + f_test.
Choices (lr, early stopping) use val only; reported numbers use test only.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from nlq.errors import NlqError

TRAIN, VAL, TEST = 0, 1, 2
PARTS = ("train", "val", "test")
BLOCK = 1 << 16  # documents per counter-seeded block of the streamed split


class Split:
    """part(i) in {TRAIN, VAL, TEST} for document i."""

    def __init__(self, seed: int, val_fraction: float, test_fraction: float,
                 n_docs: int | None, spec: str):
        self.seed, self.f_val, self.f_test = seed, val_fraction, test_fraction
        self.parts = None
        if n_docs is not None:
            need = 3 if test_fraction > 0 else 2
            if n_docs < need:
                raise NlqError(f"source {spec!r} holds {n_docs} document(s): the split is by "
                               f"document and needs at least {need}")
            n_val = min(max(1, round(val_fraction * n_docs)), n_docs - need + 1)
            self.parts = np.zeros(n_docs, dtype=np.int8)
            self.parts[np.random.default_rng(seed).choice(n_docs, n_val, replace=False)] = VAL
            if test_fraction > 0:
                rest = np.flatnonzero(self.parts == TRAIN)
                n_test = min(max(1, round(test_fraction * n_docs)), len(rest) - 1)
                pick = np.random.default_rng([seed, TEST]).choice(rest, n_test, replace=False)
                self.parts[pick] = TEST
        self._block, self._u = -1, None

    def part(self, i: int) -> int:
        if self.parts is not None:
            return int(self.parts[i])
        if i // BLOCK != self._block:
            self._block = i // BLOCK
            self._u = np.random.default_rng([self.seed, self._block]).random(BLOCK)
        u = self._u[i % BLOCK]
        return VAL if u < self.f_val else TEST if u < self.f_val + self.f_test else TRAIN


def split_docs(docs: Iterator[str], split: Split) -> Iterator[tuple[str, int]]:
    """(doc, part) for every non-empty document, in source order."""
    for i, doc in enumerate(docs):
        if doc.strip():
            yield doc, split.part(i)
