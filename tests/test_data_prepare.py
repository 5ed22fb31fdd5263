"""`nlq prepare`: sources, the document split, shards that decode back to the text,
reproducibility, re-runs, and one-line errors that leave prepared output untouched."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nlq.data import corpora, sources
from nlq.data import prepare as P
from nlq.data import tokenizers as T
from nlq.data.schedule import TokenData
from nlq.data.split import TEST, TRAIN, VAL, Split
from nlq.errors import NlqError

ROOT = Path(__file__).resolve().parents[1]
META_KEYS = {"source", "tokenizer", "vocab_size", "eot_id", "mask_id", "dtype", "train_tokens",
             "val_tokens", "test_tokens", "train_docs", "val_docs", "test_docs", "text_bytes",
             "sha256", "nlq_version", "command", "seed", "val_fraction", "test_fraction"}


def quiet(msg: str) -> None:
    pass


def run_prepare(**kw) -> dict:
    kw.setdefault("log", quiet)
    kw.setdefault("command", ["test"])
    kw.setdefault("workers", 1)
    return P.prepare(**kw)


def files_state(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """Ten documents of real text: the first 6,000 characters of ten plays."""
    return [text[:6000] for _, text in corpora.shakespeare_plays()[:10]]


@pytest.fixture(scope="module")
def txt_dir(tmp_path_factory, docs) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(docs):
        (d / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def gpt2_out(tmp_path_factory, txt_dir) -> Path:
    out = tmp_path_factory.mktemp("out") / "gpt2"
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    return out


# ---------------------------------------------------------------- embedded corpora

def test_shakespeare_is_plain_text_one_doc_per_play():
    plays = corpora.shakespeare_plays()
    assert len(plays) == 38
    names = [n for n, _ in plays]
    assert "hamlet" in names and len(set(names)) == 38
    hamlet = dict(plays)["hamlet"]
    assert hamlet.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore. A platform before the castle.")
    assert "BERNARDO\nWho's there?\n" in hamlet
    for _, text in plays:
        assert not set("*_#\\") & set(text)  # no markdown left
        assert " \n" not in text and len(text) > 50_000


def test_markdown_to_text():
    md = ("# Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter A and B_\n\n**A**  \n"
          "Good morrow,  \nsir.\n\n**B**  \n__\\[Aside]_  \nWhat, ho!--'tis\\--well\n")
    assert corpora.markdown_to_text(md) == (
        "Play\n\nACT I\n\nSCENE I. A room.\n\nEnter A and B\n\nA\nGood morrow,\nsir.\n\n"
        "B\n[Aside]\nWhat, ho!--'tis--well\n")


def test_kjv_one_doc_per_chapter():
    chapters = corpora.kjv_chapters()
    assert len(chapters) == 1189
    assert chapters[0][0] == "Genesis 1"
    assert chapters[0][1].startswith("In the beginning God created the heaven and the earth.")
    assert chapters[0][1].rstrip().endswith("And the evening and the morning were the sixth day.")
    assert chapters[-1][0] == "Revelation 22"
    assert all("[" not in t and "]" not in t for _, t in chapters)
    # embedded:all runs the plays' markdown cleaner over every document: a no-op on these
    assert all(corpora.markdown_to_text(t) == t for _, t in chapters)


def test_embedded_specs():
    s, k, a = (sources.open_source(x) for x in ("embedded", "embedded:kjv", "embedded:all"))
    assert (s.n_docs, k.n_docs, a.n_docs) == (38, 1189, 38 + 1189)
    assert list(a.docs()) == list(s.docs()) + list(k.docs())
    assert list(s.docs()) == [t for _, t in corpora.shakespeare_plays()]  # re-iterable
    assert (s.slug, k.slug, a.slug) == ("embedded", "embedded-kjv", "embedded-all")
    assert P.default_out("embedded", "bpe:8192") == Path("data/embedded-bpe8192")
    with pytest.raises(NlqError, match="embedded:poems"):
        sources.open_source("embedded:poems")


# ---------------------------------------------------------------- shards

def test_meta_and_shards(gpt2_out, txt_dir, docs):
    meta = json.loads((gpt2_out / "meta.json").read_text())
    assert META_KEYS <= set(meta)
    assert (meta["vocab_size"], meta["eot_id"], meta["mask_id"]) == (50257, 50256, None)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "gpt2"
    # round(0.2 * 10) each for val and test (the test fraction defaults to the val fraction)
    assert (meta["train_docs"], meta["val_docs"], meta["test_docs"]) == (6, 2, 2)
    assert meta["text_bytes"] == sum(len(d.encode()) for d in docs)
    assert meta["seed"] == 2357 and meta["val_fraction"] == meta["test_fraction"] == 0.2
    for name in ("train.bin", "val.bin", "test.bin"):
        assert meta["sha256"][name] == hashlib.sha256((gpt2_out / name).read_bytes()).hexdigest()
    data = TokenData.open(gpt2_out)
    assert (len(data.train), len(data.val), len(data.test)) == (
        meta["train_tokens"], meta["val_tokens"], meta["test_tokens"])
    assert sorted(p.name for p in gpt2_out.iterdir()) == ["meta.json", "test.bin", "train.bin",
                                                          "val.bin"]


def test_shards_decode_to_the_documents(gpt2_out, docs):
    """Each split is its documents in source order, each followed by one eot: compare with a
    plain tiktoken encode_ordinary of the same documents."""
    data = TokenData.open(gpt2_out)
    parts = Split(2357, 0.2, 0.2, len(docs), "x").parts
    enc = T.gpt2_encoding()
    for arr, part in ((data.train, TRAIN), (data.val, VAL), (data.test, TEST)):
        want = [d for d, p in zip(docs, parts) if p == part]
        ref = [t for d in want for t in enc.encode_ordinary(d) + [50256]]
        assert arr.tolist() == ref
        assert arr[-1] == 50256 and (arr == 50256).sum() == len(want)


def test_embedded_pipeline_equals_plain_tiktoken(tmp_path):
    """The whole embedded corpus, 2 workers that clean the markdown themselves, against a
    plain encode_ordinary of the cleaned plays in this process."""
    meta = run_prepare(source="embedded", tokenizer="gpt2", out=tmp_path / "e", workers=2)
    plays = [t for _, t in corpora.shakespeare_plays()]
    parts = Split(2357, 0.05, 0.05, len(plays), "x").parts
    assert (meta["train_docs"], meta["val_docs"], meta["test_docs"]) == (34, 2, 2)
    assert ((parts == VAL).sum(), (parts == TEST).sum()) == (2, 2)
    assert meta["text_bytes"] == sum(len(t.encode()) for t in plays)
    enc = T.gpt2_encoding()
    data = TokenData.open(tmp_path / "e")
    for arr, part in ((data.val, VAL), (data.train, TRAIN), (data.test, TEST)):
        ids = enc.encode_ordinary_batch([t for t, p in zip(plays, parts) if p == part])
        want = np.concatenate([np.array(x + [50256]) for x in ids])
        assert np.array_equal(arr, want)


def test_workers_and_reruns_are_byte_identical(tmp_path, txt_dir, gpt2_out):
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=tmp_path / "w2", val_fraction=0.2,
                workers=2)
    a, b = files_state(gpt2_out), files_state(tmp_path / "w2")
    for name in ("train.bin", "val.bin", "test.bin"):
        assert a[name] == b[name]
    ma = json.loads((gpt2_out / "meta.json").read_text())
    mb = json.loads((tmp_path / "w2" / "meta.json").read_text())
    assert ma == mb  # nothing time- or worker-dependent in meta.json


def test_seed_changes_the_split(tmp_path, txt_dir, gpt2_out):
    meta = run_prepare(source=str(txt_dir), tokenizer="gpt2", out=tmp_path / "s",
                       val_fraction=0.2, seed=1)
    assert meta["sha256"] != json.loads((gpt2_out / "meta.json").read_text())["sha256"]
    masks = {s: tuple(Split(s, 0.2, 0.2, 10, "x").parts) for s in (1, 2357)}
    assert masks[1] != masks[2357]
    assert all(m.count(VAL) == 2 and m.count(TEST) == 2 for m in masks.values())


def test_split_rules():
    def count(s, part):
        return int((s.parts == part).sum())

    assert count(Split(0, 0.001, 0.001, 10, "x"), VAL) == 1  # val always gets a document
    assert count(Split(0, 0.001, 0.001, 10, "x"), TEST) == 1  # test too
    s = Split(0, 0.5, 0.49, 10, "x")
    assert (count(s, VAL), count(s, TEST), count(s, TRAIN)) == (5, 4, 1)  # train keeps one
    assert count(Split(0, 0.05, 0.0, 38, "x"), TEST) == 0  # --test-fraction 0: no test split
    # the val documents do not depend on the test fraction
    assert ((Split(3, 0.2, 0.0, 50, "x").parts == VAL)
            == (Split(3, 0.2, 0.3, 50, "x").parts == VAL)).all()
    with pytest.raises(NlqError, match="at least 3"):
        Split(0, 0.1, 0.1, 2, "two.txt")
    with pytest.raises(NlqError, match="at least 2"):
        Split(0, 0.1, 0.0, 1, "one.txt")
    # streamed (unknown length): a pure function of (seed, index), near the fractions
    s1, s2 = Split(7, 0.1, 0.05, None, "x"), Split(7, 0.1, 0.05, None, "x")
    idx = list(range(0, 200_000, 7))
    parts = [s1.part(i) for i in idx]
    assert parts == [s2.part(i) for i in reversed(idx)][::-1]
    assert 0.09 < np.mean(np.array(parts) == VAL) < 0.11
    assert 0.04 < np.mean(np.array(parts) == TEST) < 0.06


def test_bpe_trained_on_train_split_only(tmp_path, txt_dir, docs):
    out = tmp_path / "bpe"
    meta = run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=out, val_fraction=0.2)
    assert (meta["vocab_size"], meta["eot_id"], meta["mask_id"]) == (700, 0, 1)
    parts = Split(2357, 0.2, 0.2, len(docs), "x").parts
    T.train_bpe(iter([d for d, p in zip(docs, parts) if p == TRAIN]), 700, tmp_path / "ref.json")
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "ref.json").read_bytes()
    tok = T.HFBpe(out / "tokenizer.json")
    data = TokenData.open(out)
    val_docs = [d for d, p in zip(docs, parts) if p == VAL]
    assert data.val.tolist() == [t for d in val_docs for t in tok.encode([d])[0].tolist() + [0]]
    # same input again, 2 workers: byte-identical shards and tokenizer
    run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=tmp_path / "bpe2",
                val_fraction=0.2, workers=2)
    assert files_state(out) == files_state(tmp_path / "bpe2")


def test_file_formats_and_hf_give_the_same_shards(tmp_path, docs, gpt2_out):
    """The same ten documents as .jsonl (custom field), .parquet, and a saved HF dataset."""
    pa = pytest.importorskip("pyarrow")
    import datasets
    import pyarrow.parquet as pq

    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"body": docs}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "saved"))
    want = files_state(gpt2_out)
    for spec in (tmp_path / "c.jsonl", tmp_path / "c.parquet", f"hf:{tmp_path / 'saved'}"):
        out = tmp_path / f"out-{Path(str(spec)).suffix or 'hf'}"
        run_prepare(source=str(spec), tokenizer="gpt2", out=out, val_fraction=0.2,
                    text_field="body")
        got = files_state(out)
        assert (got["train.bin"], got["val.bin"]) == (want["train.bin"], want["val.bin"]), spec


def test_hf_streamed_local_files(tmp_path, docs):
    """A folder of data files through datasets.load_dataset(streaming=True): length unknown,
    so the split is the counter-seeded one; still reproducible."""
    d = tmp_path / "stream"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"text": x}) + "\n" for x in docs * 3))
    src = sources.open_source(f"hf:{d}")
    assert src.n_docs is None and list(src.docs()) == docs * 3
    m1 = run_prepare(source=f"hf:{d}", tokenizer="gpt2", out=tmp_path / "a", val_fraction=0.3)
    m2 = run_prepare(source=f"hf:{d}", tokenizer="gpt2", out=tmp_path / "b", val_fraction=0.3)
    assert m1["sha256"] == m2["sha256"]
    assert m1["train_docs"] + m1["val_docs"] + m1["test_docs"] == 30
    parts = [Split(2357, 0.3, 0.3, None, "x").part(i) for i in range(30)]
    assert (m1["val_docs"], m1["test_docs"]) == (parts.count(VAL), parts.count(TEST))


def test_glob_and_slug(tmp_path, txt_dir):
    src = sources.open_source(str(txt_dir / "doc0*.txt"))
    assert src.n_docs == 10 and src.slug == sources.slugify(txt_dir.name)
    assert sources.source_slug("hf:openwebtext") == "openwebtext"
    assert sources.source_slug("hf:wikitext:wikitext-103-raw-v1") == "wikitext-wikitext-103-raw-v1"
    assert sources.source_slug("corpus/*.jsonl") == "corpus"
    assert sources.source_slug("some/file.jsonl") == "file"
    assert P.default_val_fraction("hf:openwebtext") == 0.0005


# ---------------------------------------------------------------- re-runs

def test_rerun_is_a_no_op_and_force_redoes(tmp_path, txt_dir):
    out = tmp_path / "o"
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    lines = []
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2,
                log=lines.append)
    assert len(lines) == 1 and "already prepared" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2, force=True)
    assert (out / "meta.json").stat().st_mtime_ns != before["meta.json"]


def test_other_args_need_force(tmp_path, txt_dir):
    out = tmp_path / "o"
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    state = files_state(out)
    with pytest.raises(NlqError, match=r"other arguments: tokenizer 'gpt2' \(now 'bpe:700'\)"):
        run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=out, val_fraction=0.2)
    with pytest.raises(NlqError, match="seed"):
        run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2, seed=3)
    assert files_state(out) == state
    meta = run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=out, val_fraction=0.2,
                       force=True)
    assert meta["tokenizer"] == "bpe:700" and (out / "tokenizer.json").is_file()
    # back to gpt2: the stale tokenizer.json goes
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2, force=True)
    assert files_state(out) == state


def test_damaged_output_with_same_args_is_redone(tmp_path, txt_dir):
    out = tmp_path / "o"
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    state = files_state(out)
    with open(out / "train.bin", "r+b") as f:
        f.truncate(100)
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    assert files_state(out) == state


# ---------------------------------------------------------------- bad input

@pytest.fixture
def prepared(tmp_path, txt_dir):
    """An output folder already prepared; every bad run below must leave it as it is."""
    out = tmp_path / "prepared"
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    return out, files_state(out)


def _bad(tmp_path, prepared, match, **kw):
    out, state = prepared
    kw = {"tokenizer": "gpt2", "val_fraction": 0.2, "out": out, "force": True, **kw}
    with pytest.raises(NlqError, match=match) as e:
        run_prepare(**kw)
    assert "\n" not in str(e.value)
    assert files_state(out) == state
    return str(e.value)


def test_missing_and_empty_sources(tmp_path, prepared):
    _bad(tmp_path, prepared, "source not found: .*nope", source=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    _bad(tmp_path, prepared, "holds no .txt", source=str(tmp_path / "empty"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text(" \n\n")
    _bad(tmp_path, prepared, "no text", source=str(tmp_path / "blank"))
    _bad(tmp_path, prepared, "matches no files", source=str(tmp_path / "*.none"))
    _bad(tmp_path, prepared, "empty --source", source="")


def test_binary_and_non_utf8_files_are_named(tmp_path, prepared, txt_dir):
    d = tmp_path / "mixed"
    d.mkdir()
    for p in list(txt_dir.iterdir())[:4]:
        (d / p.name).write_bytes(p.read_bytes())
    (d / "zz.txt").write_bytes(np.arange(256, dtype=np.uint8).tobytes())  # a binary file
    msg = _bad(tmp_path, prepared, r"zz\.txt looks like a binary file", source=str(d))
    assert "NUL byte at offset 0" in msg
    (d / "zz.txt").write_bytes("caf\u00e9 latin-1".encode("latin-1"))
    _bad(tmp_path, prepared, r"zz\.txt is not UTF-8 text \(byte 0xe9 at offset 3\)",
         source=str(d))
    (d / "zz.txt").unlink()
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    _bad(tmp_path, prepared, r"bad\.jsonl line 2 has no 'text' field", source=str(d))
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
    _bad(tmp_path, prepared, r"bad\.jsonl line 2 is not valid JSON", source=str(d))
    (d / "bad.jsonl").unlink()
    (d / "x.csv").write_text("a,b\n")
    _bad(tmp_path, prepared, r"x\.csv: unsupported file type", source=str(d / "x.csv"))


def test_parquet_and_hf_column_errors(tmp_path, prepared):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    _bad(tmp_path, prepared, r"c\.parquet has no column 'text' \(columns: body",
         source=str(tmp_path / "c.parquet"))
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not really")
    _bad(tmp_path, prepared, r"fake\.parquet is not a readable parquet file",
         source=str(tmp_path / "fake.parquet"))


def test_unknown_tokenizer_and_bad_values(tmp_path, prepared, txt_dir):
    _bad(tmp_path, prepared, "unknown tokenizer 'gpt3'", source=str(txt_dir), tokenizer="gpt3")
    _bad(tmp_path, prepared, "--val-fraction 1.5", source=str(txt_dir), val_fraction=1.5)
    _bad(tmp_path, prepared, "--workers 0|--workers -1", source=str(txt_dir), workers=-1)


def test_text_too_short_is_named(tmp_path, prepared, docs):
    d = tmp_path / "short"
    d.mkdir()
    (d / "long.txt").write_text(docs[0])
    (d / "tiny.txt").write_text("Who's there?")
    # one of the two documents goes to val: whichever it is, one split is far too short
    msg = _bad(tmp_path, prepared, r"split of .*short.* has \d+ tokens \(1 documents\), fewer "
               r"than one window of 257", source=str(d), val_fraction=0.5, test_fraction=0.0)
    assert "--val-fraction" in msg
    (d / "tiny.txt").unlink()
    _bad(tmp_path, prepared, "holds 1 document", source=str(d))


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, txt_dir, monkeypatch):
    out = tmp_path / "o"
    calls = []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a)

    real = P.encode_task
    monkeypatch.setattr(P, "encode_task", flaky)
    monkeypatch.setattr(P, "TASK_CHARS", 5000)  # several tasks
    with pytest.raises(KeyboardInterrupt):
        run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    assert not out.exists()  # the folder it created is gone again, no tmp files left
    # over a finished output (--force): the old output survives complete
    monkeypatch.setattr(P, "encode_task", real)
    run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2)
    state = files_state(out)
    calls.clear()
    monkeypatch.setattr(P, "encode_task", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(source=str(txt_dir), tokenizer="gpt2", out=out, val_fraction=0.2,
                    force=True)
    assert files_state(out) == state
    TokenData.open(out)


# ---------------------------------------------------------------- the command line

def nlq(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nlq", *args], capture_output=True, text=True,
                          cwd=cwd, check=False, env=env, timeout=120)


def test_cli_prepare(tmp_path, txt_dir):
    out = tmp_path / "cli"
    r = nlq("prepare", "--source", str(txt_dir), "--tokenizer", "gpt2", "--out", str(out),
            "--val-fraction", "0.2", "--test-fraction", "0.1", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "(7 docs)" in r.stdout and "(2 docs)" in r.stdout and "(1 docs)" in r.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"][:2] == ["nlq", "prepare"] and "--workers" in meta["command"]
    # (a re-run that finds it done is tested in-process: test_rerun_is_a_no_op_...)


@pytest.mark.parametrize("args, match", [
    (["--source", "/nonexistent/corpus"], "source not found: '/nonexistent/corpus'"),
    (["--tokenizer", "word"], "unknown tokenizer 'word'"),
])
def test_cli_errors_are_one_line(tmp_path, args, match):
    r = nlq("prepare", *args, cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nlq: error: ") and match in lines[0], r.stderr
    assert not (tmp_path / "data").exists()


def test_cli_binary_file_names_it(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_bytes(b"\x00\x01\x02" * 100)
    r = nlq("prepare", "--source", str(f), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        (f"nlq: error: {f} looks like a binary file, not text (NUL byte at offset 0); give "
         f"UTF-8 .txt, .jsonl or .parquet files")]
    assert not (tmp_path / "o").exists()


def test_a_text_field_for_sources_without_fields_is_an_error(tmp_path):
    """--text-field names a column: for .txt files or an embedded corpus it would be ignored
    yet recorded in meta.json (and a later prepare without it refused as other arguments)."""
    from nlq.errors import NlqError

    (tmp_path / "a.txt").write_text("some text\n\nmore text\n")
    with pytest.raises(NlqError, match="--text-field 'body': .* .txt files only"):
        sources.open_source(str(tmp_path / "a.txt"), "body")
    with pytest.raises(NlqError, match="embedded corpus has no fields"):
        sources.open_source("embedded:all", "body")
    assert sources.open_source(str(tmp_path / "a.txt"), "text")  # the default: fine


def test_a_trained_tokenizer_edited_since_is_prepared_again(tmp_path, txt_dir):
    """meta.json records the trained tokenizer's sha256: the same arguments over a folder whose
    tokenizer.json was edited redo the folder instead of reusing ids that now mean other text."""
    out = tmp_path / "bpe"
    meta = run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=out, val_fraction=0.2)
    tj = out / "tokenizer.json"
    good = tj.read_bytes()
    assert meta["tokenizer_sha256"] == hashlib.sha256(good).hexdigest()
    assert run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=out,
                       val_fraction=0.2) == meta  # unchanged: reused
    tj.write_bytes(good.replace(b'"merges"', b'"merges" ', 1))  # any edit
    assert run_prepare(source=str(txt_dir), tokenizer="bpe:700", out=out,
                       val_fraction=0.2)["tokenizer_sha256"] == meta["tokenizer_sha256"]
    assert tj.read_bytes() == good  # trained again, the same (deterministic)
