"""Throughput of `nlq prepare`: the whole pipeline vs a bare single-thread tiktoken.

  pipeline  prepare(source=embedded, tokenizer=gpt2, workers=2, force=True) in this process:
            read and clean the plays, split, tokenize, write and fsync the shards, meta.json
  bare      tiktoken encode_ordinary of the same documents, one thread, tokenizer already
            loaded, nothing read or written (what a plain nanoGPT-style loop gets)

Both are MB of UTF-8 text per second over --repeat interleaved runs, given for the best run
(timeit's convention: other processes only ever add time, so the fastest run is the cost of
the code) and for the median run. Goal: pipeline >= 1.5x bare, i.e. with two workers,
preparing data is clearly faster than the plainest single-thread tokenization despite the
reading, cleaning and writing it adds. Writes
benchmarks/results/prepare_bench-<date>-<commit>.json (benchmarks/record.py) and appends a
section citing it to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/prepare_bench.py [--repeat 5] [--workers 2] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this checkout's nlq (not an installed one), and record.py beside this file
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import record

from nlq.data import sources
from nlq.data.prepare import prepare
from nlq.data.tokenizers import gpt2_encoding

GOAL = 1.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--source", default="embedded")
    ap.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    record.add_arguments(ap)
    a = ap.parse_args()
    rec = record.Recorder("prepare_bench", a)  # refuses a dirty tree before measuring

    docs = [d for d in sources.open_source(a.source).docs() if d.strip()]
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    enc = gpt2_encoding()
    enc.encode_ordinary(docs[0])  # warm up the regex and the BPE cache

    bare_s, pipe_s, tokens = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeat):
            t = time.perf_counter()
            ids = [enc.encode_ordinary(d) for d in docs]
            bare_s.append(time.perf_counter() - t)
            bare_tokens = sum(map(len, ids))
            del ids
            t = time.perf_counter()
            meta = prepare(source=a.source, tokenizer="gpt2", out=tmp, workers=a.workers,
                           force=True, command=["benchmark"], log=lambda s: None,
                           progress=False)
            pipe_s.append(time.perf_counter() - t)
            tokens = meta["train_tokens"] + meta["val_tokens"]
    assert meta["text_bytes"] == n_bytes, (meta["text_bytes"], n_bytes)
    # The shards hold one end-of-text token per document on top of the bare encoding.
    assert tokens == bare_tokens + meta["train_docs"] + meta["val_docs"], (tokens, bare_tokens)

    mb = n_bytes / 1e6
    bare, pipe = mb / min(bare_s), mb / min(pipe_s)
    bare_med, pipe_med = mb / statistics.median(bare_s), mb / statistics.median(pipe_s)
    ratio, ratio_med = pipe / bare, pipe_med / bare_med
    # Other processes take cores from the 2 workers, not from the single-thread baseline.
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    import tiktoken

    result = {
        "source": a.source, "tokenizer": "gpt2",
        "workers": a.workers, "repeat": a.repeat, "text_mb": round(mb, 3), "docs": len(docs),
        "tokens": tokens,
        "pipeline_mb_s": round(pipe, 2), "bare_single_thread_mb_s": round(bare, 2),
        "ratio": round(ratio, 3), "goal_ratio": GOAL, "meets_goal": ratio >= GOAL,
        "median": {"pipeline_mb_s": round(pipe_med, 2), "bare_single_thread_mb_s":
                   round(bare_med, 2), "ratio": round(ratio_med, 3)},
        "load_average_1min": load,
        "pipeline_s": [round(s, 4) for s in pipe_s], "bare_s": [round(s, 4) for s in bare_s],
        "tiktoken": tiktoken.__version__,
    }
    print(f"text: {mb:.2f} MB, {len(docs)} docs, {tokens:,} tokens ({a.source}, gpt2)")
    print("                                          best run     median run")
    print(f"pipeline (nlq prepare, {a.workers} workers):   {pipe:6.2f} MB/s  {pipe_med:6.2f} MB/s")
    print(f"bare tiktoken encode_ordinary, 1 thread: {bare:6.2f} MB/s  {bare_med:6.2f} MB/s")
    print(f"ratio:                                    {ratio:6.2f}x      {ratio_med:6.2f}x   "
          f"(goal >= {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'} on the best run)")
    if load is not None:
        print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} cores")

    path = rec.write(result)
    if not a.no_append:
        append_results(rec, result, path)
    return 0


def append_results(rec: record.Recorder, r: dict, path: Path) -> None:
    m, hw = r["median"], record.hardware()
    # RESULTS.md cites its files relative to itself, results/...
    bench_dir = ROOT / "benchmarks"
    cited = path.relative_to(bench_dir) if path.is_relative_to(bench_dir) else path
    md = ROOT / "benchmarks/RESULTS.md"
    if not md.exists():
        md.write_text("# Benchmark results\n\nMeasured figures, newest last. Each section names "
                      "the command, hardware, date and commit.\n")
    with open(md, "a") as f:
        f.write(
            f"\n## prepare_bench ({rec.date[:10]}, commit {rec.commit[:7]}"
            f"{' + uncommitted changes' if rec.dirty else ''})\n\n"
            f"`{rec.command}` on {hw['cpu']} ({hw['cores']} cores), "
            f"torch {hw['torch']}, tiktoken {r['tiktoken']}; `{cited}`.\n"
            f"Corpus {r['source']}: {r['text_mb']} MB, {r['docs']} docs, {r['tokens']:,} gpt2 "
            f"tokens; {r['repeat']} interleaved runs, 1-min load average at the end "
            f"{r['load_average_1min']}.\n\n"
            f"| path | MB/s, best run | MB/s, median run |\n|---|---|---|\n"
            f"| nlq prepare pipeline, {r['workers']} workers | {r['pipeline_mb_s']} | "
            f"{m['pipeline_mb_s']} |\n"
            f"| bare tiktoken encode_ordinary, 1 thread | {r['bare_single_thread_mb_s']} | "
            f"{m['bare_single_thread_mb_s']} |\n"
            f"| ratio (goal >= {r['goal_ratio']}) | {r['ratio']}x | {m['ratio']}x |\n")


if __name__ == "__main__":
    raise SystemExit(main())
