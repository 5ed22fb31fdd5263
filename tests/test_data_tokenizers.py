"""GPT-2 BPE built offline equals tiktoken's and Hugging Face's; trained BPE is deterministic."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from nlq.data import corpora
from nlq.data import tokenizers as T
from nlq.errors import NlqError

# Varied text: unicode, emoji, CJK, whitespace runs, tabs/newlines, digits, code, contractions.
STRINGS = [
    "Hello world",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nand\r\nCRLF\n",
    "I'm, you're, we'll, they've, it's, he'd; DON'T SHOUT'S",
    "naïve café résumé — “quotes” ‘single’ … Œuvre ß Ångström",
    "Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "emoji 😀🙈🏳️‍🌈 👩‍👩‍👧‍👦 flags 🇩🇪🇯🇵 and ZWJ",
    "digits 1234567890 3.14159 1e-10 0xDEADBEEF 1,000,000 2026-12-02",
    "def f(x):\n    return {'a': [x**2 for x in range(10)]}  # comment\n",
    "    indented\n\t\tcode();\n        }\n",
    "multiple     spaces      between      words",
    "<|endoftext|> is only text here <|endoftext|>",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth and combining e\u0301 a\u0308",
    "mixed123abc456 ___init___ --flag=value ../../path/to/file.txt",
    "Thou art a scholar; speak to it, Horatio.\n\nMARCELLUS\nQuestion it, Horatio.",
]


@pytest.fixture(scope="module")
def gpt2():
    return T.Gpt2()


def test_gpt2_hello_world_and_constants(gpt2):
    assert [a.tolist() for a in gpt2.encode(["Hello world"])] == [[15496, 995]]
    assert (gpt2.vocab_size, gpt2.eot_id, gpt2.mask_id) == (50257, 50256, None)
    assert gpt2.enc.n_vocab == 50257
    assert gpt2.enc.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_gpt2_numpy_path_equals_encode_ordinary(gpt2):
    got = gpt2.encode(STRINGS)
    for s, a in zip(STRINGS, got):
        assert a.dtype == np.uint32
        assert a.tolist() == gpt2.enc.encode_ordinary(s), s
        assert gpt2.decode(a) == s
    # a literal special-token string in a document is ordinary text, never the eot id
    assert 50256 not in got[STRINGS.index("<|endoftext|> is only text here <|endoftext|>")]


def test_gpt2_equals_hf_transformers(gpt2):
    transformers = pytest.importorskip("transformers")
    files = T.gpt2_files()
    # transformers 5 takes vocab=/merges= (it ignores vocab_file=/merges_file=); no download.
    hf = transformers.GPT2TokenizerFast(vocab=str(files["encoder.json"]),
                                        merges=str(files["vocab.bpe"]))
    assert len(hf) == 50257
    # both read the same files; the guard is that this really loaded them
    assert hf.encode("Hello world") == [15496, 995]
    for s, a in zip(STRINGS, gpt2.encode(STRINGS)):
        if "<|endoftext|>" in s:  # HF treats it as the special token; tiktoken as text
            continue
        assert a.tolist() == hf.encode(s), s
    # a long real document: a whole play
    play = corpora.shakespeare_plays()[0][1]
    assert gpt2.encode([play])[0].tolist() == hf.encode(play)


def test_packaged_files_are_the_ones_tiktoken_pins():
    import inspect

    from tiktoken_ext import openai_public

    src = inspect.getsource(openai_public.gpt2)
    for name, path in T.gpt2_files().items():
        assert T.GPT2_SHA256[name] in src and T.GPT2_URLS[name] in src
        assert hashlib.sha256(path.read_bytes()).hexdigest() == T.GPT2_SHA256[name]
    assert T.GPT2_PAT == openai_public.r50k_pat_str


def _seed_cache(cache_dir, good=True):
    for name, url in T.GPT2_URLS.items():
        dst = cache_dir / hashlib.sha1(url.encode()).hexdigest()
        shutil.copyfile(T.gpt2_files()[name], dst)
        if not good:
            dst.write_bytes(dst.read_bytes() + b"x")


def test_tiktoken_cache_road_gives_same_encoding(tmp_path, monkeypatch, gpt2):
    """With tiktoken's cache present, get_encoding("gpt2") is used (offline: it reads the
    cache) and encodes exactly like the encoding built from the packaged files."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert T.tiktoken_cache_files() is None  # empty cache: never call get_encoding
    _seed_cache(tmp_path)
    assert T.tiktoken_cache_files() is not None
    cached = T.gpt2_encoding.__wrapped__()
    assert cached.name == "gpt2" and gpt2.enc.name == "gpt2-nlq"
    for s in STRINGS:
        assert cached.encode_ordinary(s) == gpt2.enc.encode_ordinary(s)
    assert cached._mergeable_ranks == gpt2.enc._mergeable_ranks


def test_tiktoken_cache_with_bad_hash_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    _seed_cache(tmp_path, good=False)
    assert T.tiktoken_cache_files() is None
    enc = T.gpt2_encoding.__wrapped__()  # would hang on the network if it tried tiktoken
    assert enc.name == "gpt2-nlq"


@pytest.mark.parametrize("spec", ["gpt3", "bpe", "bpe:", "bpe:x", "bpe:100", "BPE:8192", ""])
def test_unknown_tokenizer_is_named(spec):
    with pytest.raises(NlqError, match="tokenizer"):
        T.parse_spec(spec)


def test_parse_and_slug():
    assert T.parse_spec("gpt2") == ("gpt2", None)
    assert T.parse_spec("bpe:8192") == ("bpe", 8192)
    assert T.slug("bpe:8192") == "bpe8192" and T.slug("gpt2") == "gpt2"


# ---------------------------------------------------------------- trained byte-level BPE

@pytest.fixture(scope="module")
def slice_docs():
    """A small slice of real text: the first 20k characters of six plays."""
    return [text[:20_000] for _, text in corpora.shakespeare_plays()[:6]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, slice_docs):
    d = tmp_path_factory.mktemp("bpe")
    T.train_bpe(iter(slice_docs), 600, d / "a.json")
    T.train_bpe(iter(slice_docs), 600, d / "b.json")
    return d


def test_bpe_training_is_deterministic(trained):
    assert (trained / "a.json").read_bytes() == (trained / "b.json").read_bytes()


def test_bpe_specials_and_vocab(trained):
    tok = T.HFBpe(trained / "a.json", "bpe:600")
    assert (tok.eot_id, tok.mask_id) == (0, 1)
    assert tok.vocab_size == 600
    raw = json.loads((trained / "a.json").read_text())
    assert {t["content"] for t in raw["added_tokens"]} == {T.EOT, T.MASK}


def test_bpe_round_trips_any_text(trained, slice_docs):
    tok = T.HFBpe(trained / "a.json")
    texts = STRINGS + slice_docs[:2]
    for s, a in zip(texts, tok.encode(texts)):
        assert a.dtype == np.uint32 and (a < tok.vocab_size).all()
        assert tok.decode(a) == s, s  # byte-level: nothing is unknown, nothing is lost
    special = tok.encode(["a <|endoftext|> b <|mask|>"])[0]
    assert 0 not in special and 1 not in special  # specials in text stay text
    # the tokenizer compresses the text it was trained on
    ids = tok.encode(slice_docs)
    assert sum(map(len, ids)) < 0.5 * sum(len(d.encode()) for d in slice_docs)


def test_bpe_depends_on_its_training_text(tmp_path, slice_docs):
    T.train_bpe(iter(slice_docs[:3]), 600, tmp_path / "c.json")
    T.train_bpe(iter(slice_docs[3:]), 600, tmp_path / "d.json")
    assert (tmp_path / "c.json").read_bytes() != (tmp_path / "d.json").read_bytes()


def test_bad_tokenizer_json_is_named(tmp_path):
    p = tmp_path / "tokenizer.json"
    p.write_text("{not json")
    with pytest.raises(NlqError, match="tokenizer.json"):
        T.HFBpe(p)
    with pytest.raises(NlqError, match="trained by"):
        T.load("bpe:600")
