"""What a model that learned only token statistics scores on the same split as the arms: a
unigram model and a count-based bigram model fitted on the train split.

The bigram model is add-k smoothed, p(b | a) = (c(a, b) + k) / (c(a) + k V), with k chosen on
the val split from a fixed grid and the loss reported on the report's split (test where the
runs were scored on test). Pair counts come from np.unique over a * V + b, so no V x V table
is formed (V up to GPT-2's 50,257).
"""

from __future__ import annotations

import numpy as np

K_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


def unigram_loss(train: np.ndarray, split: np.ndarray, vocab: int) -> float:
    """Add-one smoothed unigram log-loss of `split` (nats per token)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    c = np.bincount(split, minlength=vocab)[:vocab]
    return float(-(c * logp).sum() / max(1, c.sum()))


class Bigram:
    def __init__(self, train: np.ndarray, vocab: int):
        x = np.asarray(train, dtype=np.int64)
        self.V = vocab
        self.keys, self.pair = np.unique(x[:-1] * vocab + x[1:], return_counts=True)
        self.first = np.bincount(x[:-1], minlength=vocab).astype(np.float64)

    def loss(self, split: np.ndarray, k: float) -> float:
        """Mean -log p(b | a) over the split's consecutive pairs (nats per predicted token)."""
        s = np.asarray(split, dtype=np.int64)
        keys = s[:-1] * self.V + s[1:]
        i = np.searchsorted(self.keys, keys).clip(max=len(self.keys) - 1)
        c = np.where(self.keys[i] == keys, self.pair[i], 0).astype(np.float64)
        p = (c + k) / (self.first[s[:-1]] + k * self.V)
        return float(-np.log(p).mean())


def references(data, split: str) -> dict:
    """Unigram and bigram log-loss on data's `split` ("test" or "val"); the bigram's k is
    chosen on val."""
    target = data.test if split == "test" else data.val
    V = data.vocab_size
    bigram = Bigram(np.asarray(data.train), V)
    k = min(K_GRID, key=lambda kk: bigram.loss(np.asarray(data.val), kk))
    return {"split": split, "unigram": unigram_loss(np.asarray(data.train), np.asarray(target), V),
            "bigram": bigram.loss(np.asarray(target), k), "bigram_k": k}
