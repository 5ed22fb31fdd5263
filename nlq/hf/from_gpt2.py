"""A Hugging Face GPT-2 folder's weights under nlq's names: the inverse of gpt2.py's mapping,
read without `transformers` (train.init_from starts a run from them).

Mapping: HF Conv1D stores weights as (in, out), nn.Linear as (out, in): transpose. HF's
fused c_attn = [q | k | v] along the output dim is split into attn.q.proj, attn.k_proj and
attn.v_proj, the linear arm's names; a nonlinear model keeps its own query's fresh init."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from nlq.errors import NlqError

QKV = ("attn.q.proj", "attn.k_proj", "attn.v_proj")
# HF name -> nlq name of the other Conv1D layers of a block
LINEAR = {"attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def nlq_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel (or GPT2Model) weights -> nlq names and layouts. Names nlq has no use
    for pass through unchanged (train.init_from reports them as dropped)."""
    out = {}
    for key, t in sd.items():
        k = key.removeprefix("transformer.")
        m = re.fullmatch(r"h\.(\d+)\.(.+)", k)
        if m is None:  # wte, wpe, ln_f, lm_head: the same names
            out[k] = t
            continue
        p, rest = f"blocks.{m[1]}.", m[2]
        if rest in ("attn.bias", "attn.masked_bias"):
            continue  # the causal-mask buffers that older transformers saved
        layer, _, kind = rest.rpartition(".")  # e.g. ("attn.c_attn", "weight")
        if layer == "attn.c_attn":  # weight (C, 3C) -> 3 x (C, C); bias (3C,) -> 3 x (C,)
            for name, part in zip(QKV, t.chunk(3, dim=-1)):
                out[f"{p}{name}.{kind}"] = part.T if kind == "weight" else part
        elif layer in LINEAR:
            out[f"{p}{LINEAR[layer]}.{kind}"] = t.T if kind == "weight" else t  # (out, in)
        else:  # ln_1, ln_2
            out[p + rest] = t
    return {k: v.contiguous() for k, v in out.items()}


def read_gpt2(path: Path) -> tuple[dict[str, torch.Tensor], Path, list[str]]:
    """(weights under nlq's names, the file they came from, what differs from nlq's GPT-2
    beyond the weights) of a GPT-2 folder that save_pretrained wrote."""
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
    return nlq_state_dict(sd), f, notes
