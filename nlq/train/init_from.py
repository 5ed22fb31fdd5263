"""train.init_from: a new run starts from the weights of another model (the retrofit).

The source is an nlq run dir (its newest checkpoint that verifies), a checkpoint dir
(RUN/ckpt/step_N), a save_pretrained folder, or a Hugging Face GPT-2 folder
(nlq/hf/from_gpt2.py). Tensors whose name and shape match are copied; the model's other
tensors keep their fresh init (a nonlinear query's f when the source is linear, whose
attn.q.proj is dropped). A shared name with another shape means another architecture: one
NlqError naming the tensor. read() runs before a new run dir is made, so a bad init_from
leaves nothing behind; apply() copies the tensors into the freshly initialised model at
step 0 only (nlq/train/loop.py): a resumed run continues from its own checkpoint.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from nlq import runfiles
from nlq.config import Config, ModelConfig
from nlq.errors import NlqError
from nlq.model import Transformer
from nlq.run import checkpoint


@dataclass
class Init:
    """The source's tensors under nlq's names, and what happens to each."""

    path: Path  # the resolved source
    weights: Path  # the file the tensors came from
    sha256: str
    tensors: dict[str, torch.Tensor]
    loaded: list[str]  # copied: name and shape match
    fresh: list[str]  # the model's, absent from the source: they keep their init
    dropped: list[str]  # the source's, absent from the model
    notes: list[str] = field(default_factory=list)  # warnings (a GPT-2 source's activation)

    def record(self) -> dict:
        """What metrics.jsonl's meta row keeps of it."""
        return {"path": str(self.path), "weights": str(self.weights), "sha256": self.sha256,
                "loaded": len(self.loaded), "fresh": self.fresh, "dropped": self.dropped}


def read(cfg: Config) -> Init | None:
    """train.init_from's tensors, checked against cfg.model's; None when it is unset."""
    if not cfg.train.init_from:
        return None
    path = Path(cfg.train.init_from).expanduser().resolve()
    tensors, weights, sha, notes = load_source(path, cfg.model.norm_eps)
    if "lm_head.weight" not in tensors and "wte.weight" in tensors:
        tensors["lm_head.weight"] = tensors["wte.weight"]  # a tied source: its head is wte
    own = shapes(cfg.model)
    for name, shape in own.items():
        if name in tensors and tensors[name].shape != shape:
            raise NlqError(
                f"train.init_from {path}: tensor {name} is {tuple(tensors[name].shape)} there "
                f"but {tuple(shape)} in this model: another architecture (the [model] sizes, "
                f"e.g. d_model, n_head, vocab_size, block_size, must be the source's)")
    loaded = [n for n in own if n in tensors]
    if not loaded:
        raise NlqError(f"train.init_from {path}: no tensor of this model is in {weights}")
    dropped = [n for n in tensors if n not in own
               and not (n == "lm_head.weight" and tensors[n] is tensors.get("wte.weight"))]
    return Init(path, weights, sha, tensors, loaded, [n for n in own if n not in tensors],
                dropped, notes)


def load_source(path: Path, norm_eps: float | None = None
                ) -> tuple[dict[str, torch.Tensor], Path, str, list[str]]:
    """(tensors under nlq's names, their file, its sha256, warnings) of any source kind;
    norm_eps: the model's, for a GPT-2 source's to be compared with."""
    if not path.exists():
        raise NlqError(f"train.init_from {path} does not exist: give a run dir, a checkpoint "
                       f"dir, a saved model or a GPT-2 folder")
    if (path / runfiles.CONFIG).is_file():  # a run dir
        if not checkpoint.any_saved(path):
            raise NlqError(f"train.init_from {path} is a run dir without a checkpoint yet")
        ck = checkpoint.load_latest(path)
        return ck.model, ck.path / "model.safetensors", ck.state["sha256"]["model.safetensors"], []
    if (path / "state.json").is_file():  # a checkpoint step dir
        try:
            state = checkpoint.verify(path)
        except ValueError as e:
            raise NlqError(f"train.init_from {path}: {e}") from None
        f = path / "model.safetensors"
        return load_file(str(f)), f, state["sha256"]["model.safetensors"], []
    if _model_type(path) == "gpt2":
        from nlq.hf.from_gpt2 import read_gpt2  # here: importing nlq.hf loads transformers

        tensors, f, notes = read_gpt2(path, norm_eps)
        return tensors, f, checkpoint.sha256(f), notes
    f = path / "model.safetensors"
    if (path / "config.json").is_file() and f.is_file():  # save_pretrained
        return load_file(str(f)), f, checkpoint.sha256(f), []
    raise NlqError(f"train.init_from {path} is not a run dir (config.toml), a checkpoint dir "
                   f"(state.json), a saved model (config.json, model.safetensors) or a GPT-2 "
                   f"folder (config.json with model_type gpt2)")


def _model_type(path: Path) -> str | None:
    """config.json's model_type (a transformers folder's), or None."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every tensor the model saves, by name (the tied head is wte's), built on the meta
    device: no memory, no init."""
    with torch.device("meta"):
        model = Transformer(cfg, seed=0)
    sd = model.state_dict()
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    return {k: v.shape for k, v in sd.items()}


def apply(init: Init, model: Transformer, verbose: bool) -> None:
    """Copy the loaded tensors into model; with verbose, say what was loaded, kept, dropped."""
    model.load_weights({n: init.tensors[n] for n in init.loaded}, strict=False)
    if not verbose:
        return
    for note in init.notes:
        print(f"nlq: warning: init_from {init.path}: {note}", file=sys.stderr)
    print(f"nlq: init_from {init.path}: {len(init.loaded)} tensors loaded, {len(init.fresh)} "
          f"kept their fresh init{_some(init.fresh)}, {len(init.dropped)} dropped"
          f"{_some(init.dropped)}", file=sys.stderr)


def _some(names: list[str], n: int = 3) -> str:
    if not names:
        return ""
    more = f", ... {len(names) - n} more" if len(names) > n else ""
    return f" ({', '.join(names[:n])}{more})"
