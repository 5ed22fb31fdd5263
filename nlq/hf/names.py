"""The one map between nlq's tensor names and layouts and Hugging Face GPT-2's
(GPT2LMHeadModel's state dict), and its two directions, both read from the same rows: to_hf
(export, gpt2.py) and to_nlq (import, from_gpt2.py). Needs no transformers (train.init_from).

Layouts: HF's Conv1D stores a weight as (in, out), nn.Linear as (out, in): transpose. HF's
c_attn fuses [q | k | v] along its output dim; nlq keeps q (attn.q.proj), k_proj and v_proj
apart: one row with three nlq names, in HF's order."""

from __future__ import annotations

import re

import torch

BASE = "transformer."  # GPT2LMHeadModel's GPT2Model (GPT2Model's own names lack it)
NLQ_BLOCK, HF_BLOCK = "blocks.{i}.", "h.{i}."  # "{i}": a block's index; HF_BLOCK is in BASE
# (nlq name, HF name) of the tensors outside the blocks, none transposed
OUTSIDE = (("wte.weight", BASE + "wte.weight"), ("wpe.weight", BASE + "wpe.weight"),
           ("ln_f.weight", BASE + "ln_f.weight"), ("ln_f.bias", BASE + "ln_f.bias"),
           ("lm_head.weight", "lm_head.weight"))
# (nlq layers, HF layer, HF's weight is a Conv1D's) in a block; each has a weight and a bias
BLOCK_LAYERS = ((("attn.q.proj", "attn.k_proj", "attn.v_proj"), "attn.c_attn", True),
                (("attn.o_proj",), "attn.c_proj", True),
                (("mlp.fc",), "mlp.c_fc", True),
                (("mlp.proj",), "mlp.c_proj", True),
                (("ln_1",), "ln_1", False),
                (("ln_2",), "ln_2", False))
# GPT2Attention's causal-mask buffers in a block (older transformers saved them): no weights
HF_BUFFERS = ("attn.bias", "attn.masked_bias")

# The map, one row per HF tensor: (nlq names, HF name, transpose)
OUTSIDE_ROWS = tuple(((ours,), theirs, False) for ours, theirs in OUTSIDE)
BLOCK_ROWS = tuple((tuple(f"{NLQ_BLOCK}{layer}.{kind}" for layer in ours),
                    f"{BASE}{HF_BLOCK}{theirs}.{kind}", conv1d and kind == "weight")
                   for ours, theirs, conv1d in BLOCK_LAYERS for kind in ("weight", "bias"))


def to_hf(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """nlq's state dict -> GPT2LMHeadModel's names and layouts. A bias nlq lacks is zero
    (HF GPT-2 always has them); any other missing tensor is a KeyError."""

    def tensor(name: str) -> torch.Tensor:
        if name in sd or not name.endswith(".bias"):
            return sd[name]
        return torch.zeros(sd[name.removesuffix("bias") + "weight"].shape[0])  # (out,)

    out = {}
    for rows, i in ((OUTSIDE_ROWS, 0), *((BLOCK_ROWS, i) for i in range(n_layer))):
        for ours, theirs, transpose in rows:
            parts = [tensor(at(name, i)) for name in ours]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)  # 3 x (C, ...) -> (3C, ...)
            out[at(theirs, i)] = (t.T if transpose else t).contiguous()  # (out, in) -> (in, out)
    return out


def to_nlq(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel (or GPT2Model) weights -> nlq's names and layouts: to_hf's inverse.
    Names the map lacks pass through, a block's prefix renamed (train.init_from reports them
    as dropped); the causal-mask buffers are left out."""
    out = {}
    for key, t in sd.items():
        name, i = template(key)
        if is_buffer(name):
            continue
        ours, transpose = _BY_HF.get(name, ((_renamed(name),), False))
        t = t.T if transpose else t  # (in, out) -> (out, in)
        # (3C, ...) -> 3 x (C, ...); one part stays the tensor itself (a tied head stays wte)
        parts = (t,) if len(ours) == 1 else t.chunk(len(ours))
        out.update((at(n, i), part.contiguous()) for n, part in zip(ours, parts))
    return out


def at(name: str, i: int | str) -> str:
    """A name of the map in block i."""
    return name.replace("{i}", str(i))


_HF_INDEX = re.compile(re.escape(HF_BLOCK).replace(re.escape("{i}"), r"(\d+)"))


def template(key: str) -> tuple[str, str]:
    """(an HF key as the map spells it, without BASE and with its block's index as "{i}";
    that index, "" outside the blocks)."""
    key = key.removeprefix(BASE)
    m = _HF_INDEX.match(key)
    return (key, "") if m is None else (HF_BLOCK + key[m.end():], m[1])


def is_buffer(key: str) -> bool:
    """Whether an HF GPT-2 key (or its template) is a causal-mask buffer, not a weight."""
    return template(key)[0] in {HF_BLOCK + b for b in HF_BUFFERS}


def _renamed(name: str) -> str:
    """nlq's name for an HF template the map lacks: the same, in nlq's block."""
    return NLQ_BLOCK + name.removeprefix(HF_BLOCK) if name.startswith(HF_BLOCK) else name


_BY_HF = {template(theirs)[0]: (ours, transpose)
          for ours, theirs, transpose in OUTSIDE_ROWS + BLOCK_ROWS}
