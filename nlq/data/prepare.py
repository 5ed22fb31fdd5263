"""`nlq prepare`: documents -> a train/val/test split by document -> token shards.

Output in DIR: train.bin, val.bin and test.bin (raw uint16 / uint32 arrays, every document followed by
the end-of-text token), tokenizer.json for a trained bpe:N, and meta.json, which
nlq.data.schedule.TokenData.open reads.

The split is by document and seeded (nlq/data/split.py; default seed 2357 and, for
OpenWebText, val fraction 0.0005: the paper's nanoGPT recipe, docs/paper.md, "The training
recipe"; the test split is as large as val by default). The same input and seed give
byte-identical shards, whatever --workers is: the worker pool and its tasks are
nlq/data/encode.py.

Crash safety: the shards are written as *.tmp files and moved into place with meta.json last
(nlq/data/shards.py), so an interrupted or failed run never leaves a folder that looks complete;
Ctrl-C (or a failure) before that leaves DIR as it was, and a run killed outright leaves only
*.tmp files, which the next run there removes. DIR must be new, empty or an nlq data dir (a
folder of other files is refused: its train.bin would be someone else's), and a lock file in it
(removed at the end) stops a second `nlq prepare` from writing there at the same time: those
checks, and the reuse of a finished output, are nlq/data/outdir.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nlq import __version__
from nlq.data import sources, tokenizers
from nlq.data.encode import (
    TASK_CHARS,
    encode_all,
    encode_task,
    forget_tokenizers,
    make_pool,
    sigint_ignored,
    tasks,
    use_tokenizer,
)
from nlq.data.outdir import ARG_KEYS, LOCK, TMP_NAMES, check_ours, existing, lock_out
from nlq.data.shards import ShardWriter, commit
from nlq.data.split import PARTS, TRAIN, Split, split_docs
from nlq.errors import NlqError
from nlq.fsutil import unlock
from nlq.progress import bar_interval

# the encoding (encode.py) and the output folder's checks (outdir.py) live beside prepare;
# their names stay importable from here
__all__ = ["ARG_KEYS", "DEFAULT_SEED", "DEFAULT_SOURCE", "DEFAULT_TOKENIZER", "LOCK",
           "MAX_SEED", "MIN_SPLIT_TOKENS", "PAPER_VAL_FRACTION", "SMALL_VAL_FRACTION",
           "TASK_CHARS", "TMP_NAMES", "default_out", "default_val_fraction", "dtype_for",
           "encode_all", "encode_task", "make_pool", "prepare", "sigint_ignored", "tasks",
           "write_shards"]

DEFAULT_SOURCE = "embedded"
DEFAULT_TOKENIZER = "bpe:8192"  # the tiny preset reads data/embedded-bpe8192
# docs/paper.md, "The training recipe": OpenWebText's validation split is 0.05%, seed 2357
DEFAULT_SEED = 2357
PAPER_VAL_FRACTION = 0.0005
SMALL_VAL_FRACTION = 0.05  # 2 of the 38 embedded plays: enough text to evaluate on
# The shortest split we accept: one window of 256 tokens + 1 target. A floor that catches a
# split too small to evaluate on; TokenData.check enforces each model's own block_size.
MIN_SPLIT_TOKENS = 257
MAX_SEED = 2**63 - 1  # as train.seed and data.seed: any int64 >= 0 (numpy takes no negative)


def default_val_fraction(source: str) -> float:
    return PAPER_VAL_FRACTION if source == "hf:openwebtext" else SMALL_VAL_FRACTION


def default_out(source: str, tokenizer: str) -> Path:
    return Path("data") / f"{sources.source_slug(source)}-{tokenizers.slug(tokenizer)}"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# ---------------------------------------------------------------- prepare

def prepare(source: str = DEFAULT_SOURCE, tokenizer: str = DEFAULT_TOKENIZER,
            out: str | Path | None = None, val_fraction: float | None = None,
            test_fraction: float | None = None, seed: int = DEFAULT_SEED, workers: int | None = None, force: bool = False,
            text_field: str = "text", command: list[str] | None = None,
            log: Callable[[str], None] = print, progress: bool | None = None) -> dict:
    """Prepare token shards; returns the meta dict (also written to DIR/meta.json)."""
    t0 = time.perf_counter()
    kind, bpe_vocab = tokenizers.parse_spec(tokenizer)
    val_fraction = default_val_fraction(source) if val_fraction is None else float(val_fraction)
    if not 0.0 < val_fraction < 1.0:
        raise NlqError(f"--val-fraction {val_fraction} must be strictly between 0 and 1")
    test_fraction = val_fraction if test_fraction is None else float(test_fraction)
    if not 0.0 <= test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
        raise NlqError(f"--test-fraction {test_fraction} must be in [0, 1) and leave a train "
                       f"split beside --val-fraction {val_fraction}")
    if not 0 <= seed <= MAX_SEED:
        raise NlqError(f"--seed {seed} must be in [0, 2**63 - 1]")
    if workers is None:
        workers = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1)
    if workers < 1:
        raise NlqError(f"--workers {workers} must be >= 1")
    out = Path(out) if out is not None else default_out(source, tokenizer)
    args = {"source": source, "tokenizer": tokenizer, "val_fraction": val_fraction,
            "test_fraction": test_fraction, "seed": seed, "text_field": text_field}
    if out.exists() and not out.is_dir():
        raise NlqError(f"--out {out} exists and is not a folder")
    # the folders this run creates (out and missing parents), removed again if left empty
    created = [d for d in (out, *out.parents) if not d.exists()]
    held = None
    try:
        if not created:
            check_ours(out)
        out.mkdir(parents=True, exist_ok=True)
        held = lock_out(out)
        for name in TMP_NAMES:  # left by a run that was killed outright
            (out / name).unlink(missing_ok=True)
        done = None if force else existing(out, args)
        if done is not None:
            log(f"{out}: already prepared ({done['train_tokens']:,} train / "
                f"{done['val_tokens']:,} val tokens); nothing to do (--force redoes it)")
            return done
        meta = _write(out, args, workers, command, log, progress)
    except OSError as e:  # a full disk, a read-only --out
        where = f" ({e.filename})" if e.filename else ""
        raise NlqError(f"nlq prepare into {out} failed: {e.strerror or e}{where}; its "
                       f"temporary files are removed: free space or choose another --out, "
                       f"then run it again") from None
    finally:
        # the cleanup must not hide the error: on a read-only disk even unlinking fails
        if held is not None:
            unlock(out / LOCK, held)
        with contextlib.suppress(OSError):  # OSError: not empty (or a read-only disk)
            for d in created:
                d.rmdir()
    note = "" if kind == "gpt2" or meta["vocab_size"] == bpe_vocab else \
        f" (the text supports only {meta['vocab_size']} of the {bpe_vocab} requested)"
    log(f"{out}: {meta['train_tokens']:,} train tokens ({meta['train_docs']} docs), "
        f"{meta['val_tokens']:,} val tokens ({meta['val_docs']} docs), "
        f"{meta.get('test_tokens', 0):,} test tokens ({meta.get('test_docs', 0)} docs), vocab "
        f"{meta['vocab_size']}{note}, {meta['dtype']}, {meta['text_bytes'] / 1e6:.1f} MB of "
        f"text in {time.perf_counter() - t0:.1f} s")
    return meta


def _write(out: Path, args: dict, workers: int, command: list[str] | None,
           log: Callable[[str], None], progress: bool | None) -> dict:
    """Tokenize into DIR (locked by the caller) and commit; on any error or Ctrl-C, remove
    what this run wrote and leave DIR as it was."""
    source, tokenizer, seed = args["source"], args["tokenizer"], args["seed"]
    kind, bpe_vocab = tokenizers.parse_spec(tokenizer)
    val_fraction, test_fraction = args["val_fraction"], args["test_fraction"]
    tok_tmp = out / "tokenizer.json.tmp"
    tok_path = str(tok_tmp) if kind == "bpe" else None
    writers: list[ShardWriter] = []
    pool = None
    try:
        # Workers start first, so they load gpt2 while this process opens the corpus (a bpe:N
        # tokenizer loads on their first task, once trained).
        pool = make_pool(workers, tokenizer, tok_path) if workers > 1 else None
        src = sources.open_source(source, args["text_field"])
        split = Split(seed, val_fraction, test_fraction, src.n_docs, source)
        if kind == "bpe":
            log(f"training byte-level BPE of vocab {bpe_vocab} on the train split of {source}")
            tokenizers.train_bpe((t for t, p in split_docs(src.docs(), split) if p == TRAIN),
                                 bpe_vocab, tok_tmp)
        # gpt2's vocab and ids are class constants: with workers, this process skips the load.
        tok = tokenizers.Gpt2 if kind == "gpt2" and pool else tokenizers.load(tokenizer, tok_path)
        if pool is None:
            use_tokenizer(tokenizer, tok_path, tok)
        names = PARTS if test_fraction > 0 else PARTS[:2]
        for name in names:
            writers.append(ShardWriter(out / f"{name}.bin"))
        counts = write_shards(src, split, tok, (tokenizer, tok_path), writers, pool, workers,
                              progress)
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        for name, w in zip(names, writers):
            if w.n < MIN_SPLIT_TOKENS:
                raise NlqError(
                    f"the {name} split of {source!r} has {w.n} tokens ({counts[name]} "
                    f"documents), fewer than one window of {MIN_SPLIT_TOKENS} (256 + 1 "
                    f"target): give more text or change --val-fraction / --test-fraction "
                    f"({val_fraction} / {test_fraction})")
        meta = {
            "source": source, "tokenizer": tokenizer, "vocab_size": int(tok.vocab_size),
            "eot_id": int(tok.eot_id),
            "mask_id": None if tok.mask_id is None else int(tok.mask_id),
            "dtype": dtype_for(tok.vocab_size).name,
            **{f"{name}_tokens": w.n for name, w in zip(names, writers)},
            **{f"{name}_docs": counts[name] for name in names},
            "text_bytes": counts["bytes"],
            "sha256": {f"{name}.bin": w.sha.hexdigest() for name, w in zip(names, writers)},
            # a trained tokenizer is part of what the ids mean: a reuse checks it (outdir.py)
            **({"tokenizer_sha256": hashlib.sha256(tok_tmp.read_bytes()).hexdigest()}
               if kind == "bpe" else {}),
            "nlq_version": __version__,
            "command": command if command is not None else ["nlq", *sys.argv[1:]],
            "seed": seed, "val_fraction": val_fraction, "test_fraction": test_fraction,
            "text_field": args["text_field"],
        }
        with sigint_ignored():
            commit(out, writers, tok_tmp if kind == "bpe" else None, meta)
        return meta
    except BaseException:
        try:
            if pool is not None:
                # Not pool.terminate(): it hangs for good if its task thread is sending a
                # task (one larger than the pipe) as the workers die. No task is added now,
                # so the workers finish the few in flight (encode_all) and exit.
                pool.close()
                pool.join()
        finally:
            # the cleanup must not hide the error: on a full disk a close's flush fails too,
            # on a read-only one even unlinking a missing file does
            for w in writers:
                with contextlib.suppress(OSError):
                    w.f.close()
            # by name, not by writer: Ctrl-C may come between a file's creation and its writer
            with contextlib.suppress(OSError):
                for name in TMP_NAMES:
                    (out / name).unlink(missing_ok=True)
        raise
    finally:
        forget_tokenizers()


def write_shards(src: sources.Source, split: Split, tok, tok_key: tuple,
                 writers: list[ShardWriter], pool, workers: int,
                 progress: bool | None) -> dict:
    """Encode every document into writers [train, val, test] (their .tmp files, fsynced); returns
    document counts and text bytes. Raw documents go to the workers, which clean them
    (src.clean) and encode; results come back in document order."""
    from tqdm import tqdm

    counts = {name: 0 for name in PARTS} | {"bytes": 0}
    job = (*tok_key, dtype_for(tok.vocab_size).name, src.clean)
    # encode_task and TASK_CHARS by this module's names: a caller (the tests) may swap them
    # here, e.g. for a task that fails midway or for smaller tasks
    with tqdm(total=src.n_bytes, unit="B", unit_scale=True, desc="tokenizing",
              mininterval=bar_interval(), disable=None if progress is None else not progress) as bar:
        for arrs, n_docs, n_bytes in encode_all(
                job, tasks(split_docs(src.iterate(), split), TASK_CHARS), workers, pool,
                encode_task):
            for w, arr in zip(writers, arrs):  # no test writer: the test part is empty
                w.write(arr)
            for name, n in zip(PARTS, n_docs):
                counts[name] += n
            counts["bytes"] += n_bytes
            bar.update(n_bytes)
    for w in writers:
        w.close()
    return counts
