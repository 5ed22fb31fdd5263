"""A Hugging Face GPT-2 folder's weights under nlq's names, read without `transformers`
(train.init_from starts a run from them). The map is names.py's, inverted (to_nlq): HF's
fused c_attn becomes the linear arm's attn.q.proj, k_proj and v_proj; a nonlinear model keeps
its own query's fresh init."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from nlq.errors import NlqError
from nlq.hf.names import to_nlq

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_gpt2(path: Path, norm_eps: float | None = None
              ) -> tuple[dict[str, torch.Tensor], Path, list[str]]:
    """(weights under nlq's names, the file they came from, what differs from nlq's GPT-2
    beyond the weights) of a GPT-2 folder that save_pretrained wrote; norm_eps: the nlq
    model's, compared with the folder's layer_norm_epsilon."""
    files = [path / f for f in WEIGHT_FILES if (path / f).is_file()]
    if not files:
        raise NlqError(f"{path} holds a GPT-2 config.json but none of {', '.join(WEIGHT_FILES)} "
                       f"(a sharded checkpoint is not supported)")
    f = files[0]
    try:
        sd = (load_file(str(f)) if f.suffix == ".safetensors"
              else torch.load(f, map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise NlqError(f"cannot read GPT-2 weights {f}: {e}") from None
    hf = json.loads((path / "config.json").read_text())
    notes = []
    act = hf.get("activation_function", "gelu_new")
    if act != "gelu":  # GPT-2's own checkpoints use gelu_new, the tanh approximation
        notes.append(f"its MLP activation is {act!r}, nlq's is the exact (erf) GELU: the "
                     f"weights load, the function differs slightly")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            notes.append(f"{flag} = true has no nlq equivalent")
    if hf.get("scale_attn_weights") is False:
        notes.append("scale_attn_weights = false (no 1/sqrt(head size)): nlq scales the "
                     "attention logits, so the function differs")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if norm_eps is not None and eps != norm_eps:
        notes.append(f"its layer_norm_epsilon is {eps}, this model's model.norm_eps "
                     f"{norm_eps}: set model.norm_eps = {eps} for the same function")
    return to_nlq(sd), f, notes
