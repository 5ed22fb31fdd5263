"""A trained model and its tokenizer, from what nlq writes.

A model comes from a run dir (its newest checkpoint that verifies), a checkpoint step dir
(RUN/ckpt/step_N) or a `save_pretrained` folder (config.json + model.safetensors). Its
tokenizer comes from the data dir the run trained on (meta.json names it; a trained bpe:N is
that dir's tokenizer.json), or from a data dir given explicitly."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from nlq.config import load_config, model_config_from_dict
from nlq.data.tokenizers import Tokenizer, load
from nlq.errors import NlqError
from nlq.model.transformer import Transformer
from nlq.train.checkpoint import any_saved, load_latest, verify
from nlq.train.memory import check_inference_fits


def load_model(path: str | Path) -> tuple[Transformer, Path | None]:
    """(the model in eval mode, the data dir its run trained on or None if unknown). Before
    anything is read, the model's size is checked against the memory free (a config edited to
    a size this machine cannot hold is one line, not an allocator traceback)."""
    p = Path(path)
    if not p.exists():
        raise NlqError(f"{p} does not exist: give a run dir, a checkpoint dir or a saved model")
    if (p / "config.toml").is_file():  # a run dir
        if not any_saved(p):
            raise NlqError(f"{p} has no checkpoint yet: a run writes one every "
                           f"train.ckpt_interval steps and at its end")
        check_inference_fits(load_config(p / "config.toml").model, str(p))
        ck = load_latest(p)
        model = _from_state(ck.state["model_config"], ck.model)
        return model, Path(load_config(p / "config.toml").data.dir)
    if (p / "state.json").is_file():  # a checkpoint step dir
        try:
            state = verify(p)
        except ValueError as e:
            raise NlqError(f"checkpoint {p}: {e}") from None
        check_inference_fits(model_config_from_dict(state["model_config"]), str(p))
        model = _from_state(state["model_config"], load_file(str(p / "model.safetensors")))
        run = p.parent.parent
        data = Path(load_config(run / "config.toml").data.dir) if (
            run / "config.toml").is_file() else None
        return model, data
    if (p / "config.json").is_file():
        try:
            raw = json.loads((p / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NlqError(f"{p / 'config.json'} is not readable JSON: {e}") from None
        check_inference_fits(model_config_from_dict(raw), str(p))
        return Transformer.from_pretrained(p).eval(), None
    raise NlqError(f"{p} is not a run dir (config.toml), a checkpoint dir (state.json) or a "
                   f"saved model (config.json)")


def _from_state(model_config: dict, weights: dict) -> Transformer:
    model = Transformer(model_config_from_dict(model_config), seed=0)
    model.load_weights(weights)
    return model.eval()


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared data dir was made with."""
    d = Path(data_dir)
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NlqError(f"no readable meta.json in data dir {d} ({e}): give the data dir the "
                       f"model was trained on with --data") from None
    spec = meta.get("tokenizer")
    if not isinstance(spec, str):
        raise NlqError(f"{d / 'meta.json'} names no tokenizer")
    return load(spec, d / "tokenizer.json" if spec != "gpt2" else None)


def check_vocab(model: Transformer, tok: Tokenizer, data_dir: Path) -> None:
    if tok.vocab_size > model.cfg.vocab_size:
        raise NlqError(f"the tokenizer of {data_dir} ({tok.spec}, {tok.vocab_size} tokens) does "
                       f"not fit the model (vocab_size {model.cfg.vocab_size}): another "
                       f"tokenizer than the model trained with")


def run_config(path: str | Path):
    """The Config of the run a run dir or checkpoint dir belongs to, or None."""
    p = Path(path)
    for d in (p, p.parent.parent):
        if (d / "config.toml").is_file():
            return load_config(d / "config.toml")
    return None


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two prepared data dirs were tokenized alike (spec and tokenizer.json bytes)."""
    def key(d: Path):
        meta = json.loads((d / "meta.json").read_text())
        tj = d / "tokenizer.json"
        return meta.get("tokenizer"), tj.read_bytes() if tj.is_file() else None
    return key(a) == key(b)
