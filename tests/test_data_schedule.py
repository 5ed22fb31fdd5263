"""The batch schedule (nlq.data.schedule): one shared order for every arm, world size and
resume point, windows inside the data, and TokenData.open reading what prepare writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nlq.data.schedule import (
    MLM_TRAIN,
    TokenData,
    micro_indices,
    mlm_corrupt,
    train_batch,
    val_windows,
)
from nlq.errors import NlqError

SEED, T, MB, ACCUM = 2357, 16, 3, 4


def write_data(d, train: np.ndarray, val: np.ndarray, vocab: int, **meta_over) -> None:
    d.mkdir(parents=True, exist_ok=True)
    train.tofile(d / "train.bin")
    val.tofile(d / "val.bin")
    meta = {"dtype": train.dtype.name, "vocab_size": vocab, "tokenizer": "test",
            "train_tokens": len(train), "val_tokens": len(val), **meta_over}
    (d / "meta.json").write_text(json.dumps(meta))


@pytest.fixture
def positions() -> np.ndarray:
    """Token i has value i: every window shows where it was cut from."""
    return np.arange(1000, dtype=np.uint16)


def test_two_arms_see_identical_batches(positions):
    for step in (0, 1, 59_999):
        for micro in range(ACCUM):
            a = train_batch(positions, SEED, step, micro, MB, ACCUM, T)
            b = train_batch(positions.copy(), SEED, step, micro, MB, ACCUM, T)
            assert torch.equal(a, b)
    assert not torch.equal(train_batch(positions, SEED, 0, 0, MB, ACCUM, T),
                           train_batch(positions, SEED + 1, 0, 0, MB, ACCUM, T))
    assert torch.equal(val_windows(positions, SEED, 8, T), val_windows(positions, SEED, 8, T))


def test_world_sizes_partition_the_same_global_batch(positions):
    step = 17
    full = torch.cat([train_batch(positions, SEED, step, m, MB, ACCUM, T)
                      for m in micro_indices(ACCUM, 0, 1)])
    for world in (2, 4):
        ranks = [list(micro_indices(ACCUM, r, world)) for r in range(world)]
        assert sorted(m for r in ranks for m in r) == list(range(ACCUM))  # a partition
        assert all(len(r) == ACCUM // world for r in ranks)
        shards = torch.cat([train_batch(positions, SEED, step, m, MB, ACCUM, T)
                            for r in ranks for m in r])
        assert torch.equal(shards, full)
    with pytest.raises(NlqError, match="grad_accum = 4 must be divisible by the world size 3"):
        micro_indices(ACCUM, 0, 3)


def test_resume_at_step_k_equals_continuing(positions):
    """The schedule is a pure function of the step: batches after a resume at step k equal
    those of the uninterrupted run, whatever was drawn before."""
    uninterrupted = [train_batch(positions, SEED, s, m, MB, ACCUM, T)
                     for s in range(10) for m in range(ACCUM)]
    k = 6
    val_windows(positions, SEED, 32, T)  # a fresh process may evaluate first: no shared state
    resumed = [train_batch(positions, SEED, s, m, MB, ACCUM, T)
               for s in range(k, 10) for m in range(ACCUM)]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[k * ACCUM:], resumed))
    # and steps differ from one another
    assert not torch.equal(uninterrupted[0], uninterrupted[ACCUM])


@pytest.mark.parametrize("n", [T + 1, T + 2, 50, 1000])
def test_no_window_runs_past_the_end(n):
    data = np.arange(n, dtype=np.uint32)
    seen_last = False
    for step in range(200):
        x = train_batch(data, SEED, step, step % ACCUM, MB, ACCUM, T)
        assert x.shape == (MB, T + 1) and x.dtype == torch.int64
        assert (x[:, 1:] - x[:, :-1] == 1).all()  # contiguous windows
        assert int(x.min()) >= 0 and int(x.max()) <= n - 1
        seen_last |= bool((x[:, -1] == n - 1).any())
    v = val_windows(data, SEED, 64, T)
    assert int(v.max()) <= n - 1 and (v[:, 1:] - v[:, :-1] == 1).all()
    if n <= 50:
        assert seen_last  # the last token is reachable: starts cover [0, n - T - 1]


@pytest.mark.parametrize("dtype, top", [(np.uint16, 2**16 - 1), (np.uint32, 2**32 - 1)])
def test_dtypes_round_trip_through_open(tmp_path, dtype, top):
    rng = np.random.default_rng(0)
    train = rng.integers(0, top, 500, endpoint=True, dtype=np.uint64).astype(dtype)
    train[:2] = [0, top]
    val = rng.integers(0, top, 100, endpoint=True, dtype=np.uint64).astype(dtype)
    write_data(tmp_path / "d", train, val, vocab=top + 1)
    data = TokenData.open(tmp_path / "d")
    assert data.train.dtype == dtype and data.vocab_size == top + 1
    assert np.array_equal(data.train, train) and np.array_equal(data.val, val)
    x = train_batch(data.train, SEED, 0, 0, 2, 1, 8)
    assert x.dtype == torch.int64 and int(x.max()) <= top and int(x.min()) >= 0
    for row in x.numpy():  # every window is a slice of the stored tokens
        assert any(np.array_equal(train[s:s + 9].astype(np.int64), row) for s in range(492))


def test_open_errors_name_the_file(tmp_path):
    with pytest.raises(NlqError, match=f"data dir not found: {tmp_path / 'nope'}"):
        TokenData.open(tmp_path / "nope")
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(NlqError, match="no meta.json"):
        TokenData.open(d)
    write_data(d, np.arange(100, dtype=np.uint16), np.arange(50, dtype=np.uint16), vocab=100)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "train_tokens": 99}))
    with pytest.raises(NlqError, match=r"train\.bin holds 200 bytes but meta\.json says 99 "
                                       r"uint16 tokens"):
        TokenData.open(d)
    (d / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))  # 150 bytes of val
    with pytest.raises(NlqError, match=r"train\.bin holds 200 bytes"):
        TokenData.open(d)
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "val.bin").unlink()
    with pytest.raises(NlqError, match=r"missing .*val\.bin"):
        TokenData.open(d)
    (d / "meta.json").write_text("{oops")
    with pytest.raises(NlqError, match=r"meta\.json is not valid JSON"):
        TokenData.open(d)


def test_check_names_vocab_and_short_splits(tmp_path):
    write_data(tmp_path / "d", np.arange(300, dtype=np.uint16), np.arange(20, dtype=np.uint16),
               vocab=8192)
    data = TokenData.open(tmp_path / "d")
    with pytest.raises(NlqError, match="vocab 8192 .* model.vocab_size = 512"):
        data.check(512, 16)
    with pytest.raises(NlqError, match=r"val\.bin has 20 tokens, too short .* = 33"):
        data.check(8192, 32)
    data.check(8192, 19)  # 20 tokens = one window of 19 + 1


def test_mlm_masking_is_shared_and_bert_like():
    tokens = torch.arange(20_000).reshape(20, 1000) % 500 + 2
    a = mlm_corrupt(tokens, SEED, (MLM_TRAIN, 5, 0), 0.15, mask_id=1, vocab_size=512)
    b = mlm_corrupt(tokens, SEED, (MLM_TRAIN, 5, 0), 0.15, mask_id=1, vocab_size=512)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    inputs, targets = a
    chosen = targets != -1
    assert 0.14 < chosen.float().mean() < 0.16
    assert torch.equal(targets[chosen], tokens[chosen])
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    masked = (inputs == 1)[chosen].float().mean()
    kept = (inputs == tokens)[chosen].float().mean()
    assert 0.78 < masked < 0.82 and 0.08 < kept < 0.12  # 80% mask, 10% keep (+ rare same)
    c = mlm_corrupt(tokens, SEED, (MLM_TRAIN, 6, 0), 0.15, mask_id=1, vocab_size=512)
    assert not torch.equal(c[1], targets)


def test_prepare_output_opens_with_the_schedule(tmp_path):
    """End to end: a prepared embedded slice feeds train_batch (uint16 gpt2 tokens)."""
    from nlq.data import corpora
    from nlq.data.prepare import prepare

    d = tmp_path / "plays"
    d.mkdir()
    for name, text in corpora.shakespeare_plays()[:4]:
        (d / f"{name}.txt").write_text(text[:4000])
    prepare(source=str(d), tokenizer="gpt2", out=tmp_path / "out", val_fraction=0.25,
            workers=1, log=lambda s: None, command=["test"])
    data = TokenData.open(tmp_path / "out")
    data.check(50304, 64)
    x = train_batch(data.train, SEED, 3, 1, 2, 2, 64)
    assert x.shape == (2, 65) and int(x.max()) < 50257


@pytest.mark.parametrize("key, value", [("eot_id", 9999), ("eot_id", "x"), ("eot_id", None),
                                        ("mask_id", 5000), ("mask_id", -1)])
def test_a_bad_special_id_in_meta_is_named_before_training(tmp_path, key, value):
    """eot_id cuts the test split into documents and mask_id is an input id: out of the vocab
    they failed after training (an IndexError in the test scoring), leaving the run unfinished."""

    from helpers import make_data

    d = make_data(tmp_path / "d")
    meta = json.loads((d / "meta.json").read_text())
    if value is None:
        meta.pop(key)
    else:
        meta[key] = value
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(NlqError, match=f"no valid '{key}'"):
        TokenData.open(d)
