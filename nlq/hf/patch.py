"""Swap the query projection of a transformers model for an nlq query module, in place.

Supported (the model or any head model around it, found through `model.base_model`):
- GPT-2: GPT2Model, GPT2LMHeadModel, ... Its c_attn is one fused Conv1D, x -> [q | k | v];
  it becomes FusedQKV, which computes q with the query module and k, v with c_attn's own
  k and v columns (HF's weights kept), and returns the same [q | k | v] that GPT2Attention
  splits. Only the self-attention `attn` of each block is patched.
- Llama family: LlamaModel, LlamaForCausalLM, ...; MistralModel, Qwen2Model and their
  heads alike. Each layer's `self_attn.q_proj` (an nn.Linear, C -> C) becomes the module.

The paper's 1/2: Q = (X + f(X)) / 2 with the usual 1/sqrt(hs) logit scale (docs/paper.md,
"The nonlinear query"). HF's attention keeps its own scale, so the module must return the
whole Q: NonlinearQuery is built with half="explicit" and a query whose scale_factor is
not 1 (half="fold") is refused rather than have its factor silently dropped.

Legend: B batch, T time, C = d_model (hidden size).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from nlq.errors import NlqError
from nlq.extras import need
from nlq.model.layers import RMSNorm
from nlq.model.query import QUERIES, LinearQuery

LLAMA_FAMILY = ("LlamaModel", "MistralModel", "Qwen2Model")


class FusedQKV(nn.Module):
    """GPT-2's c_attn with its q columns replaced by a query module: x (B, T, C) ->
    [query(x) | k | v] (B, T, 3C). kv is a Conv1D (weight (C, 2C), as HF stores it)."""

    def __init__(self, query: nn.Module, c_attn: nn.Module):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        C = c_attn.weight.shape[0]
        self.q = query
        self.kv = Conv1D(2 * C, C).to(c_attn.weight)
        with torch.no_grad():
            self.kv.weight.copy_(c_attn.weight[:, C:])  # (C, 2C): the k and v columns
            self.kv.bias.copy_(c_attn.bias[C:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.kv(x)], dim=-1)  # (B, T, 3C)


def patch_queries(model: nn.Module, query: str = "nonlinear", *, init_std: float = 0.02,
                  **query_kwargs) -> nn.Module:
    """Replace the query projection of every attention layer of `model` (GPT-2 or Llama
    family, see the module docstring) by nlq's QUERIES[query](d_model=C, **query_kwargs);
    returns model, patched in place.

    query="linear" keeps the model's own W_Q (and bias): the logits do not change. Any other
    query (or linear where the query is no longer linear) is new: Linear weights drawn
    N(0, init_std^2) from torch's global generator (nlq's init), biases 0, norms at weight
    1, bias 0; "identity" has no weights. Biases in the new module follow query_kwargs
    (bias=False by default, as the paper). Patching again replaces the query only (GPT-2
    keeps its k, v). To reload a patched model saved with save_pretrained: build it, patch
    it the same way, then load_state_dict.

    Tests (tests/test_hf_patch.py): a patched GPT-2 gives the logits of nlq's own
    Transformer with the same weights; a patched Llama those of the unpatched one whose
    q_proj output is replaced by (x + f(x)) / 2 computed by hand (nlq cannot express a
    Llama block: RMSNorm, SwiGLU)."""
    transformers = need("transformers", "patch_queries")
    layers = _attention_layers(model, transformers)
    if query not in QUERIES:
        raise NlqError(f"unknown query {query!r} (one of {', '.join(QUERIES)})")
    if query == "nonlinear":
        if query_kwargs.get("half", "explicit") != "explicit":
            raise NlqError("patch_queries needs half='explicit': HF's attention keeps its "
                           "own scale, so the query must return the whole (X + f(X)) / 2")
        query_kwargs["half"] = "explicit"
    # the query's norms take the host's epsilon (GPT-2 layer_norm_epsilon, Llama rms_norm_eps)
    # unless given: nlq's own model gives them its norm_eps
    host_eps = getattr(model.config, "layer_norm_epsilon", None) or getattr(
        model.config, "rms_norm_eps", None)
    if host_eps is not None and "norm_eps" in inspect.signature(QUERIES[query]).parameters:
        query_kwargs.setdefault("norm_eps", host_eps)
    C = model.config.hidden_size
    for attn, name in layers:
        old = getattr(attn, name)
        like = (attn.c_proj if name == "c_attn" else attn.o_proj).weight  # device, dtype
        new = _build(query, C, *_w_q(old), init_std, query_kwargs).to(like)
        if isinstance(old, FusedQKV):  # patched before: keep its k, v
            old.q = new
        else:
            setattr(attn, name, FusedQKV(new, old) if name == "c_attn" else new)
    return model


def _w_q(old: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The current linear query's (W_Q (C, C) as nn.Linear, bias or None); (None, None) when
    it is not linear (already patched with another query)."""
    if isinstance(old, FusedQKV):
        old = old.q
    if type(old).__name__ == "Conv1D":  # GPT-2's c_attn (C, 3C): q is the first C columns
        C = old.weight.shape[0]
        return old.weight[:, :C].T, old.bias[:C]
    old = old.proj if isinstance(old, LinearQuery) else old
    return (old.weight, old.bias) if isinstance(old, nn.Linear) else (None, None)


def _attention_layers(model: nn.Module, transformers) -> list[tuple[nn.Module, str]]:
    """(module, attribute name of its query projection) for every attention layer."""
    base = getattr(model, "base_model", model)
    if isinstance(base, transformers.GPT2Model):
        return [(block.attn, "c_attn") for block in base.h]
    family = tuple(c for c in (getattr(transformers, n, None) for n in LLAMA_FAMILY) if c)
    if isinstance(base, family):
        out = [(layer.self_attn, "q_proj") for layer in base.layers]
        for attn, _ in out:
            if isinstance(attn.q_proj, nn.Linear) and (
                    attn.q_proj.in_features != attn.q_proj.out_features):
                raise NlqError(f"{type(model).__name__}: q_proj maps {attn.q_proj.in_features}"
                               f" -> {attn.q_proj.out_features} features; an nlq query keeps "
                               f"the width (n_heads * head_dim must equal hidden_size)")
        return out
    raise NlqError(f"patch_queries does not support {type(model).__name__}: GPT-2 "
                   f"(GPT2Model, GPT2LMHeadModel, ...) and the Llama family "
                   f"({', '.join(LLAMA_FAMILY)} and their heads) only")


def _build(query: str, C: int, w: torch.Tensor | None, b: torch.Tensor | None,
           init_std: float, kwargs: dict) -> nn.Module:
    """The query module for width C, freshly initialised; linear copies W_Q (w, b) if any."""
    keep = query == "linear" and w is not None
    if keep:
        kwargs = {**kwargs, "bias": b is not None}
    try:
        module = QUERIES[query](d_model=C, **kwargs)
    except TypeError as e:
        raise NlqError(f"query {query!r} cannot be built from plain arguments: {e}") from None
    if getattr(module, "scale_factor", 1.0) != 1.0:
        raise NlqError(f"query {query!r} has scale_factor {module.scale_factor}, which HF's "
                       f"attention cannot apply: build it to return the whole query")
    with torch.no_grad():
        for mod in module.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, init_std)
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, (nn.LayerNorm, RMSNorm)):
                mod.weight.fill_(1.0)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
        if keep:
            module.proj.weight.copy_(w)
            if b is not None:
                module.proj.bias.copy_(b)
    return module
