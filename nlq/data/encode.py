"""The tokenisation of `nlq prepare`: documents grouped into tasks and encoded, by a pool of
worker processes or in this process, results in document order.

The worker functions (_init_worker, encode_task) live at module level: a pool pickles them
by name, and a spawned worker imports them from here. Each worker loads the tokenizer once
and keeps it (_worker_tok); without a pool, the caller hands this process's own tokenizer
to use_tokenizer and removes it with forget_tokenizers.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from nlq.data import tokenizers
from nlq.data.split import PARTS

TASK_CHARS = 1 << 18  # characters of text per worker task: small enough to balance 2 workers


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


def use_tokenizer(spec: str, path: str | None, tok: tokenizers.Tokenizer) -> None:
    """Without a pool this process encodes: give it the tokenizer it has already loaded
    (a bpe:N one just trained) instead of loading it again on the first task."""
    _worker_tok.clear()
    _worker_tok[(spec, path)] = tok


def forget_tokenizers() -> None:
    """Drop this process's tokenizer: a later prepare may write another one at that path."""
    _worker_tok.clear()


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


def encode_all(job: tuple, task_iter: Iterator[list], workers: int, pool=None,
               encode: Callable[[tuple, list], tuple] = encode_task) -> Iterator[tuple]:
    """encode (encode_task unless told) over all tasks, results in task order. With a pool,
    at most 4 tasks per worker are in flight, so a streamed corpus never sits in memory and
    stopping early (an error, Ctrl-C) waits for those few only."""
    if pool is None:
        for batch in task_iter:
            yield encode(job, batch)
        return
    pending = deque()
    for batch in task_iter:
        pending.append(pool.apply_async(encode, (job, batch)))
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
