"""`nlq prepare`: documents -> a train/val/test split by document -> token shards.

Output in DIR: train.bin, val.bin and test.bin (raw uint16 / uint32 arrays, every document followed by
the end-of-text token), tokenizer.json for a trained bpe:N, and meta.json, which
nlq.data.schedule.TokenData.open reads.

The split is by document and seeded (nlq/data/split.py; default seed 2357 and, for
OpenWebText, val fraction 0.0005: the paper's nanoGPT recipe, docs/paper.md, "The training
recipe"; the test split is as large as val by default). The same input and seed give
byte-identical shards, whatever --workers is.

Crash safety: the shards are written as *.tmp files and moved into place with meta.json last
(nlq/data/shards.py), so an interrupted or failed run never leaves a folder that looks complete;
Ctrl-C (or a failure) before that leaves DIR as it was, and a run killed outright leaves only
*.tmp files, which the next run there removes. DIR must be new, empty or an nlq data dir (a
folder of other files is refused: its train.bin would be someone else's), and a lock file in it
(removed at the end) stops a second `nlq prepare` from writing there at the same time.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from nlq import __version__
from nlq.data import sources, tokenizers
from nlq.data.schedule import TokenData
from nlq.data.shards import ShardWriter, commit
from nlq.data.split import PARTS, TRAIN, Split, split_docs
from nlq.errors import NlqError
from nlq.fsutil import Locked, lock, unlock

DEFAULT_SOURCE = "embedded"
DEFAULT_TOKENIZER = "bpe:8192"  # the tiny preset reads data/embedded-bpe8192
# docs/paper.md, "The training recipe": OpenWebText's validation split is 0.05%, seed 2357
DEFAULT_SEED = 2357
PAPER_VAL_FRACTION = 0.0005
SMALL_VAL_FRACTION = 0.05  # 2 of the 38 embedded plays: enough text to evaluate on
# The shortest split we accept: one window of 256 tokens + 1 target. A floor that catches a
# split too small to evaluate on; TokenData.check enforces each model's own block_size.
MIN_SPLIT_TOKENS = 257
TASK_CHARS = 1 << 18  # characters of text per worker task: small enough to balance 2 workers
# The arguments that determine the output: a finished folder with other values is not redone
# (or overwritten) without --force.
ARG_KEYS = ("source", "tokenizer", "val_fraction", "test_fraction", "seed", "text_field")
MAX_SEED = 2**63 - 1  # as train.seed and data.seed: any int64 >= 0 (numpy takes no negative)
LOCK = ".nlq-prepare.lock"
# what a run killed outright leaves in DIR (with the lock file); the next run removes them
TMP_NAMES = (*(f"{name}.bin.tmp" for name in PARTS), "tokenizer.json.tmp", ".meta.json.tmp")


def default_val_fraction(source: str) -> float:
    return PAPER_VAL_FRACTION if source == "hf:openwebtext" else SMALL_VAL_FRACTION


def default_out(source: str, tokenizer: str) -> Path:
    return Path("data") / f"{sources.source_slug(source)}-{tokenizers.slug(tokenizer)}"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# ---------------------------------------------------------------- worker tasks

def tasks(docs: Iterator[tuple[str, bool]], chars: int | None = None) -> Iterator[list]:
    """Group (text, part) pairs into worker tasks of about `chars` characters."""
    chars = chars or TASK_CHARS
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[0])
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------- workers

_worker_tok: dict = {}  # per worker process: (spec, path) -> loaded tokenizer


def _tokenizer(spec: str, path: str | None) -> tokenizers.Tokenizer:
    key = (spec, path)
    if key not in _worker_tok:
        _worker_tok.clear()
        _worker_tok[key] = tokenizers.load(spec, path)
    return _worker_tok[key]


@contextlib.contextmanager
def sigint_ignored():
    """Ctrl-C is ignored inside: while a pool forks its workers (they inherit it, so only
    this process answers Ctrl-C: no traceback from every worker) and while commit renames
    files (stopping between two renames would leave neither the old output nor the new)."""
    if threading.current_thread() is not threading.main_thread():  # signal needs the main one
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _init_worker(spec: str, path: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also in a worker the pool starts later
    # gpt2: load now, while the parent is still reading the corpus. A pool respawns a worker
    # whose initializer raises, forever, so a failure is left for the first task to raise.
    if path is None:
        with contextlib.suppress(Exception):
            _tokenizer(spec, path)


def encode_task(job: tuple, batch: list):
    """One task. job = (tokenizer spec, tokenizer.json path or None, dtype name, the
    source's clean function or None); batch = [(raw doc, part)]. Returns (ids per part,
    documents per part, UTF-8 bytes of text), each document's ids followed by the end-of-text
    id, as arrays of dtype."""
    spec, path, dtype, clean = job
    tok = _tokenizer(spec, path)
    if clean is not None:
        batch = [(t, v) for t, v in ((clean(d), v) for d, v in batch) if t.strip()]
    texts = [t for t, _ in batch]
    ids = tok.encode(texts)
    eot = np.array([tok.eot_id], dtype=np.uint32)
    parts = [[] for _ in PARTS]
    for a, (_, part) in zip(ids, batch):
        parts[part] += [a, eot]
    arrs = [np.concatenate(p).astype(dtype) if p else np.zeros(0, dtype) for p in parts]
    n_bytes = sum(len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts)
    n_docs = [sum(p == i for _, p in batch) for i in range(len(PARTS))]
    return arrs, n_docs, n_bytes


def encode_all(job: tuple, task_iter: Iterator[list], workers: int,
               pool=None) -> Iterator[tuple]:
    """encode_task over all tasks, results in task order. With a pool, at most 4 tasks per
    worker are in flight, so a streamed corpus never sits in memory and stopping early (an
    error, Ctrl-C) waits for those few only."""
    if pool is None:
        for batch in task_iter:
            yield encode_task(job, batch)
        return
    pending = deque()
    for batch in task_iter:
        pending.append(pool.apply_async(encode_task, (job, batch)))
        if len(pending) >= 4 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def make_pool(workers: int, spec: str, path: str | None):
    # fork starts workers in milliseconds. HF tokenizers warns in a child forked after its
    # threads ran (e.g. an earlier prepare in this process) unless parallelism is configured.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with sigint_ignored():
            return mp.get_context(method).Pool(workers, _init_worker, (spec, path))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# ---------------------------------------------------------------- an earlier output

def _check_ours(out: Path) -> None:
    """Refuse a folder of other files: its train.bin or tokenizer.json would be replaced.
    nlq's own are empty, hold a data dir's meta.json, or hold the lock file (a prepare runs
    there, or was killed there)."""
    names = {p.name for p in out.iterdir()}
    if not names or LOCK in names:
        return
    with contextlib.suppress(OSError, ValueError):  # ValueError: not JSON, not UTF-8
        meta = json.loads((out / "meta.json").read_text())
        if isinstance(meta, dict) and {"tokenizer", "vocab_size", "dtype"} <= meta.keys():
            return
    raise NlqError(f"--out {out} holds other files and is not an nlq data dir (no meta.json "
                   f"from nlq prepare): nothing was written; choose a new or empty folder")


def _lock(out: Path) -> int:
    try:
        return lock(out / LOCK)
    except Locked as e:
        raise NlqError(f"{out} is being written by another nlq prepare (pid {e.pid}); wait for "
                       f"it to finish or choose another --out") from None


def _existing(out: Path, args: dict) -> dict | None:
    """meta of a finished output made with the same args; None if there is nothing finished
    there; an error if it was made with other args (nothing is overwritten without --force)."""
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NlqError(f"{meta_path} exists but is not valid JSON: not overwriting it (use "
                       f"--force or another --out)") from None
    diff = [k for k in ARG_KEYS if meta.get(k) != args[k]]
    if diff:
        was = ", ".join(f"{k} {meta.get(k)!r} (now {args[k]!r})" for k in diff)
        raise NlqError(f"{out} was prepared with other arguments: {was}; use --force to "
                       f"replace it or choose another --out")
    try:
        TokenData.open(out)
    except NlqError:
        return None  # same args but damaged shards: redo them
    return meta


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
            _check_ours(out)
        out.mkdir(parents=True, exist_ok=True)
        held = _lock(out)
        for name in TMP_NAMES:  # left by a run that was killed outright
            (out / name).unlink(missing_ok=True)
        done = None if force else _existing(out, args)
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
            _worker_tok.clear()
            _worker_tok[(tokenizer, tok_path)] = tok
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
        _worker_tok.clear()


def write_shards(src: sources.Source, split: Split, tok, tok_key: tuple,
                 writers: list[ShardWriter], pool, workers: int,
                 progress: bool | None) -> dict:
    """Encode every document into writers [train, val, test] (their .tmp files, fsynced); returns
    document counts and text bytes. Raw documents go to the workers, which clean them
    (src.clean) and encode; results come back in document order."""
    from tqdm import tqdm

    counts = {name: 0 for name in PARTS} | {"bytes": 0}
    job = (*tok_key, dtype_for(tok.vocab_size).name, src.clean)
    with tqdm(total=src.n_bytes, unit="B", unit_scale=True, desc="tokenizing",
              disable=None if progress is None else not progress) as bar:
        for arrs, n_docs, n_bytes in encode_all(
                job, tasks(split_docs(src.iterate(), split)), workers, pool):
            for w, arr in zip(writers, arrs):  # no test writer: the test part is empty
                w.write(arr)
            for name, n in zip(PARTS, n_docs):
                counts[name] += n
            counts["bytes"] += n_bytes
            bar.update(n_bytes)
    for w in writers:
        w.close()
    return counts
