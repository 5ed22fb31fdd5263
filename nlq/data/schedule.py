"""The batch schedule: every arm sees the same windows in the same order, with no index files.

The official code stores the shared sample order in index files of several GB (docs/paper.md,
"Known defects of the official code").
Here a window's start is a pure function of (data seed, step, global window index), drawn
from a counter-seeded numpy generator, so the schedule costs O(1) memory and a resumed run
continues with exactly the batch it would have seen: the only state is the step number.

Global batch at a step: grad_accum micro-batches of micro_batch windows of T+1 tokens,
the same whatever the world size. Rank r of W runs grad_accum / W micro-steps and takes the
contiguous share j = r * (grad_accum / W) + m of the global micro-batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nlq.errors import NlqError

# Independent streams of the data seed (numpy SeedSequence entropy words).
_TRAIN, _VAL, _MLM_TRAIN, _MLM_VAL, _MLM_TEST = 0, 1, 2, 3, 4


@dataclass
class TokenData:
    """A folder written by `nlq prepare`: train.bin / val.bin / test.bin memmaps plus
    meta.json. test is None for a folder prepared without a test split."""

    dir: Path
    meta: dict
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray | None = None

    @classmethod
    def open(cls, dir: str | Path) -> TokenData:
        d = Path(dir)
        meta_path = d / "meta.json"
        if d.exists() and not d.is_dir():
            raise NlqError(f"data dir {d} is a file, not a folder written by `nlq prepare`")
        if not d.is_dir():
            raise NlqError(f"data dir not found: {d} (run `nlq prepare --out {d}` first)")
        if not meta_path.is_file():
            raise NlqError(f"no meta.json in data dir {d} (run `nlq prepare --out {d}`)")
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise NlqError(f"{meta_path} is not valid JSON: {e}") from None
        try:
            dtype = np.dtype(meta["dtype"])
        except (KeyError, TypeError):
            raise NlqError(f"{meta_path} has no valid 'dtype' (uint16 or uint32)") from None
        if dtype not in (np.uint16, np.uint32):
            raise NlqError(f"{meta_path} says dtype {meta['dtype']!r}: token shards are uint16 "
                           f"or uint32 (re-run `nlq prepare --out {d} --force`)")
        vocab = meta.get("vocab_size")
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            raise NlqError(f"{meta_path} has no valid 'vocab_size' (a positive integer), got "
                           f"{vocab!r} (re-run `nlq prepare --out {d} --force`)")
        if vocab > np.iinfo(dtype).max + 1:
            # ids >= 2**16 cannot be stored as uint16: the shards would hold wrapped ids
            raise NlqError(f"{meta_path} says vocab_size {vocab} but dtype {dtype.name}, which "
                           f"holds ids below {np.iinfo(dtype).max + 1} only: meta.json and its "
                           f"shards disagree (re-run `nlq prepare --out {d} --force`)")
        # the special ids index the embedding and split the documents: checked here, before a
        # run trains on them (a bad one failed after training, in the test scoring)
        for key in ("eot_id", "mask_id"):
            v = meta.get(key)
            if v is None and (key == "mask_id" or "test_tokens" not in meta):
                continue  # no mask token; or no test split to cut into documents
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab:
                raise NlqError(f"{meta_path} has no valid {key!r} (an integer id in [0, "
                               f"vocab_size = {vocab})), got {v!r} (re-run `nlq prepare --out "
                               f"{d} --force`)")
        splits = {}
        for split in ("train", "val", "test"):
            path = d / f"{split}.bin"
            if split == "test" and "test_tokens" not in meta:
                continue  # prepared without a test split (or before nlq had one)
            if not path.is_file():
                raise NlqError(f"missing {path} (re-run `nlq prepare --out {d} --force`)")
            n = path.stat().st_size // dtype.itemsize
            want = meta.get(f"{split}_tokens")
            if path.stat().st_size % dtype.itemsize or (want is not None and n != want):
                raise NlqError(
                    f"{path} holds {path.stat().st_size} bytes but meta.json says {want} "
                    f"{dtype.name} tokens: the file is truncated or from another run "
                    f"(re-run `nlq prepare --out {d} --force`)"
                )
            splits[split] = np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
        return cls(d, meta, splits["train"], splits["val"], splits.get("test"))

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check(self, vocab_size: int, block_size: int, eval_windows: int = 1) -> None:
        """Errors for shards the model cannot use: another vocab, too short for a window."""
        if self.vocab_size > vocab_size:
            raise NlqError(
                f"data in {self.dir} has vocab {self.vocab_size} (tokenizer "
                f"{self.meta.get('tokenizer')!r}) but model.vocab_size = {vocab_size}: set "
                f"model.vocab_size >= {self.vocab_size} or prepare data with another tokenizer"
            )
        for split, arr in (("train", self.train), ("val", self.val)):
            if len(arr) < block_size + 1:
                raise NlqError(
                    f"{self.dir}/{split}.bin has {len(arr)} tokens, too short for one window "
                    f"of model.block_size + 1 = {block_size + 1}"
                )


    def test_docs(self) -> list[np.ndarray]:
        """The test split's documents, each with its closing end-of-text token; an error
        naming the folder when it has no test split."""
        return self.docs("test")

    def docs(self, split: str) -> list[np.ndarray]:
        """A split's documents, each with its closing end-of-text token."""
        arr = {"train": self.train, "val": self.val, "test": self.test}[split]
        if arr is None:
            raise NlqError(f"{self.dir} has no test split: re-run `nlq prepare --force` with "
                           f"the arguments in its meta.json (or set train.test_eval = false)")
        ends = np.flatnonzero(np.asarray(arr) == self.meta["eot_id"]) + 1
        return [d for d in np.split(np.asarray(arr), ends[:-1]) if len(d)]

    def check_ids(self, windows: torch.Tensor, split: str, what: str) -> None:
        """Every id of windows (read from split.bin) must be below the data's vocab_size: a
        bin that disagrees with its meta.json is named here, not inside the embedding. Costs
        one max over the windows a step reads anyway."""
        top = int(windows.max()) if windows.numel() else 0
        if top >= self.vocab_size:
            raise NlqError(
                f"{self.dir / f'{split}.bin'} holds token id {top} in {what}, but its meta.json "
                f"says vocab_size {self.vocab_size}: the shards and meta.json disagree (re-run "
                f"`nlq prepare --out {self.dir} --force`)"
            )


def _starts(rng: np.random.Generator, n_tokens: int, T: int, count: int) -> np.ndarray:
    # A window is T+1 tokens, so the last valid start is n_tokens - T - 1.
    return rng.integers(0, n_tokens - T, size=count, dtype=np.int64)


def _gather(data: np.ndarray, starts: np.ndarray, T: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(T + 1)[None, :]  # (B, T+1)
    return torch.from_numpy(data[idx].astype(np.int64))  # (B, T+1)


def micro_indices(grad_accum: int, rank: int, world: int) -> range:
    """The global micro-batch indices that rank `rank` of `world` runs at every step."""
    if grad_accum % world:
        raise NlqError(
            f"train.grad_accum = {grad_accum} must be divisible by the world size {world} so "
            f"the global batch stays as configured"
        )
    per = grad_accum // world
    return range(rank * per, (rank + 1) * per)


def train_batch(data: np.ndarray, seed: int, step: int, micro: int, micro_batch: int,
                grad_accum: int, T: int) -> torch.Tensor:
    """Windows (micro_batch, T+1) of global micro-batch `micro` at optimizer step `step`."""
    rng = np.random.default_rng([seed, _TRAIN, step])
    starts = _starts(rng, len(data), T, grad_accum * micro_batch)  # the whole global batch
    return _gather(data, starts[micro * micro_batch:(micro + 1) * micro_batch], T)


def val_windows(data: np.ndarray, seed: int, count: int, T: int) -> torch.Tensor:
    """The fixed eval set: `count` windows (count, T+1), the same for every arm and eval."""
    rng = np.random.default_rng([seed, _VAL])
    return _gather(data, _starts(rng, len(data), T, count), T)


def mlm_corrupt(tokens: torch.Tensor, seed: int, key: tuple[int, ...], prob: float,
                mask_id: int, vocab_size: int,
                first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (Devlin et al. 2019): choose `prob` of the positions; of those 80% become
    mask_id, 10% a random token, 10% stay. Returns (inputs, targets with -1 = no loss).
    tokens: (b, T), the windows first_row .. first_row + b - 1 of what `key` names (a step's
    windows, the val set, the test windows). Each window's draw is a function of (seed, key,
    its index) alone, so every arm, world size and micro-batch split masks the same tokens."""
    u, how, rand_tok = (np.empty(tokens.shape), np.empty(tokens.shape),
                        np.empty(tokens.shape, dtype=np.int64))
    for j in range(tokens.shape[0]):
        rng = np.random.default_rng([seed, *key, first_row + j])
        u[j], how[j] = rng.random(tokens.shape[1]), rng.random(tokens.shape[1])
        rand_tok[j] = rng.integers(0, vocab_size, size=tokens.shape[1])
    chosen = torch.from_numpy(u < prob)
    inputs = tokens.clone()
    inputs[chosen & torch.from_numpy(how < 0.8)] = mask_id
    swap = chosen & torch.from_numpy((how >= 0.8) & (how < 0.9))
    inputs[swap] = torch.from_numpy(rand_tok)[swap]
    targets = torch.where(chosen, tokens, torch.full_like(tokens, -1))
    return inputs, targets


MLM_TRAIN, MLM_VAL, MLM_TEST = _MLM_TRAIN, _MLM_VAL, _MLM_TEST
