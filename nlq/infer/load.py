"""A trained model and its tokenizer, from what nlq writes.

A model comes from a run dir (its newest checkpoint, or the step asked for; one that fails
to verify is an error), a checkpoint step dir (RUN/ckpt/step_N), a `save_pretrained` folder
(config.json + model.safetensors) or a model_type "nlq" folder `nlq convert --to hf` wrote
(it records the step; a `--to gpt2` folder is transformers' to load). Its tokenizer comes
from the data dir the run trained on (meta.json names it; a trained bpe:N is that dir's
tokenizer.json), or from a data dir given explicitly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from nlq import runfiles
from nlq.config import load_config, model_config_from_dict
from nlq.data.tokenizers import Tokenizer, load
from nlq.errors import NlqError
from nlq.extras import need
from nlq.infer.convert import converted_step
from nlq.model import Transformer, apply_fast_paths
from nlq.run.checkpoint import chosen, verify
from nlq.run.memory import check_inference_fits


@dataclass
class Loaded:
    model: Transformer  # in eval mode
    data: Path | None  # the data dir its run trained on, None if unknown
    step: int | None  # the training step of its weights, None if the folder does not say
    source: Path  # the checkpoint dir or saved folder the weights were read from


def load_model(path: str | Path) -> tuple[Transformer, Path | None]:
    """(the model in eval mode, the data dir its run trained on or None if unknown)."""
    got = load_trained(path)
    return got.model, got.data


def load_trained(path: str | Path, step: int | None = None) -> Loaded:
    """The model of a run dir (checkpoint `step`, default its newest: one that fails to verify
    is an error, never replaced by an older one), a checkpoint dir or a saved folder. Before
    anything is read, the model's size is checked against the memory free (a config edited to
    a size this machine cannot hold is one line, not an allocator traceback)."""
    p = Path(path)
    if not p.exists():
        raise NlqError(f"{p} does not exist: give a run dir, a checkpoint dir or a saved model")
    if (p / runfiles.CONFIG).is_file():  # a run dir
        cfg = load_config(p / runfiles.CONFIG)
        check_inference_fits(cfg.model, str(p))  # before hashing a checkpoint too large
        ck, state = chosen(p, step)
        return _from_checkpoint(ck, state, Path(cfg.data.dir))
    if (p / "state.json").is_file():  # a checkpoint step dir
        try:
            state = verify(p)
        except ValueError as e:
            raise NlqError(f"checkpoint {p}: {e}") from None
        if step is not None and step != state["step"]:
            raise NlqError(f"--step {step}: checkpoint {p} is of step {state['step']} (give "
                           f"the run dir to choose a step)")
        run = p.parent.parent
        data = Path(load_config(run / runfiles.CONFIG).data.dir) if (
            run / runfiles.CONFIG).is_file() else None
        return _from_checkpoint(p, state, data)
    if (p / "config.json").is_file():
        try:
            raw = json.loads((p / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NlqError(f"{p / 'config.json'} is not readable JSON: {e}") from None
        saved = converted_step(p)
        if step is not None and step != saved:
            raise NlqError(f"--step {step}: {p} is a saved model folder, of step "
                           f"{'unknown' if saved is None else saved}; give the run dir to "
                           f"choose a step")
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        if kind == "gpt2":  # `nlq convert --to gpt2`: transformers' format, not nlq's
            raise NlqError(f"{p} is a transformers GPT-2 folder (`nlq convert --to gpt2`): "
                           f"load it with transformers' GPT2LMHeadModel, or give nlq the run "
                           f"or checkpoint it was converted from")
        if kind == "nlq":  # `nlq convert --to hf`: the nlq Transformer inside the HF model
            return Loaded(_from_hf(p), None, saved, p)
        check_inference_fits(model_config_from_dict(raw), str(p))
        return Loaded(Transformer.from_pretrained(p).eval(), None, saved, p)
    raise NlqError(f"{p} is not a run dir (config.toml), a checkpoint dir (state.json) or a "
                   f"saved model (config.json)")


def _from_hf(p: Path) -> Transformer:
    """The nlq Transformer of a model_type "nlq" folder (`nlq convert --to hf`)."""
    need("transformers", "reading a model_type 'nlq' folder")
    from nlq.hf.auto import NlqConfig, NlqForCausalLM, NlqForMaskedLM

    try:
        cfg = NlqConfig.from_pretrained(p).nlq_config()
    except (OSError, ValueError, TypeError) as e:
        raise NlqError(f"{p / 'config.json'}: not a model_type 'nlq' config ({e})") from None
    check_inference_fits(cfg, str(p))
    cls = NlqForMaskedLM if cfg.arch == "encoder" else NlqForCausalLM
    try:
        model = cls.from_pretrained(p).model
    except (OSError, ValueError) as e:
        raise NlqError(f"{p}: its weights cannot be read ({e})") from None
    apply_fast_paths(model, compile_query=False)  # as a checkpoint loads: the same numbers
    return model.eval()


def _from_checkpoint(d: Path, state: dict, data: Path | None) -> Loaded:
    check_inference_fits(model_config_from_dict(state["model_config"]), str(d))
    try:
        weights = load_file(str(d / "model.safetensors"))
    except SafetensorError as e:  # its sha256 matched: written so, not damaged since
        raise NlqError(f"checkpoint {d}: model.safetensors is not readable ({e})") from None
    return Loaded(_from_state(state["model_config"], weights), data, int(state["step"]), d)


def _from_state(model_config: dict, weights: dict) -> Transformer:
    model = Transformer(model_config_from_dict(model_config), seed=0)
    model.load_weights(weights)
    # the kernels training ran, so eval gives its numbers exactly; no compile start-up
    apply_fast_paths(model, compile_query=False)
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
        if (d / runfiles.CONFIG).is_file():
            return load_config(d / runfiles.CONFIG)
    return None


def check_same_data(run_data: Path | None, data: Path, purpose: str) -> None:
    """An explicit data dir must be tokenized as the one the model trained on (where that is
    known and still there): another tokenizer's ids mean other text."""
    if not (data / "meta.json").is_file():
        raise NlqError(f"--data {data} is not a prepared data dir (no meta.json)")
    if run_data is not None and Path(data) != run_data and (run_data / "meta.json").is_file() \
            and not same_tokenizer(run_data, Path(data)):
        raise NlqError(f"data {data} was tokenized otherwise than the data the model trained "
                       f"on ({run_data}): {purpose}")


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two prepared data dirs were tokenized alike (spec and tokenizer.json bytes)."""
    def key(d: Path):
        meta = json.loads((d / "meta.json").read_text())
        tj = d / "tokenizer.json"
        return meta.get("tokenizer"), tj.read_bytes() if tj.is_file() else None
    return key(a) == key(b)
