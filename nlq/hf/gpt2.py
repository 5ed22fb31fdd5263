"""nlq's linear arm is GPT-2 (tests/test_model_hf_parity.py): its weights as a
`transformers.GPT2LMHeadModel` with the same logits, in memory or as a folder that
`GPT2LMHeadModel.from_pretrained` loads.

Mapping: HF Conv1D stores weights as (in, out), nn.Linear as (out, in): transpose. HF fuses
c_attn = [q | k | v] along the output dim; nlq keeps q (attn.q.proj), k_proj, v_proj apart.
A model without biases gets zero biases (HF GPT-2 always has them): the same function."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from nlq.errors import NlqError


def check_gpt2(cfg) -> None:
    """An error naming the first setting GPT-2 cannot express."""
    hs = cfg.d_model // cfg.n_head
    scale = cfg.attn_scale if cfg.attn_scale is not None else 1 / math.sqrt(hs)
    problems = [
        (cfg.arch != "decoder", f"arch {cfg.arch!r} (GPT-2 is a decoder)"),
        (cfg.query != "linear", (f"query {cfg.query!r} (GPT-2's query is linear: export the "
                                 f"linear arm, or write model_type nlq: --to hf)")),
        (cfg.n_kv_head not in (None, cfg.n_head), f"n_kv_head {cfg.n_kv_head} (GQA)"),
        (cfg.pos_emb != "learned", f"pos_emb {cfg.pos_emb!r} (GPT-2 learns positions)"),
        (cfg.qk_norm, "qk_norm (GPT-2 has none)"),
        (abs(scale * cfg.attn_scale_mult - 1 / math.sqrt(hs)) > 1e-12,
         "an attention scale other than 1/sqrt(head size)"),
    ]
    for bad, what in problems:
        if bad:
            raise NlqError(f"this model cannot be written as GPT-2: {what}")


def gpt2_config(cfg):
    import transformers

    return transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.d_model,
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.mlp_width,
        activation_function="gelu",  # the exact erf GELU, as nn.GELU()
        layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None)


def gpt2_state_dict(model) -> dict[str, torch.Tensor]:
    """nlq weights -> GPT2LMHeadModel's state dict names and layouts."""
    cfg, sd = model.cfg, model.state_dict()
    C = cfg.d_model

    def bias(name: str, n: int) -> torch.Tensor:
        return sd.get(name, torch.zeros(n))

    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"],
           "transformer.ln_f.bias": bias("ln_f.bias", C),
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = ("attn.q.proj", "attn.k_proj", "attn.v_proj")
        out[h + "attn.c_attn.weight"] = torch.cat([sd[p + n + ".weight"] for n in qkv]).T  # (C, 3C)
        out[h + "attn.c_attn.bias"] = torch.cat([bias(p + n + ".bias", C) for n in qkv])
        for ours, theirs, n_out in (("attn.o_proj", "attn.c_proj", C),
                                    ("mlp.fc", "mlp.c_fc", cfg.mlp_width),
                                    ("mlp.proj", "mlp.c_proj", C)):
            out[h + theirs + ".weight"] = sd[p + ours + ".weight"].T  # (in, out)
            out[h + theirs + ".bias"] = bias(p + ours + ".bias", n_out)
        for ln in ("ln_1", "ln_2"):
            out[h + ln + ".weight"] = sd[p + ln + ".weight"]
            out[h + ln + ".bias"] = bias(p + ln + ".bias", C)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def to_gpt2(model):
    """A transformers.GPT2LMHeadModel (eval mode) computing the same logits as model."""
    try:
        import transformers
    except ImportError:
        raise NlqError("GPT-2 export needs transformers: pip install 'nlq[hf]'") from None
    check_gpt2(model.cfg)
    hf = transformers.GPT2LMHeadModel(gpt2_config(model.cfg)).eval()
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(model), strict=False)
    # HF may keep non-persistent attention-mask buffers; every weight must have been set
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise NlqError(f"GPT-2 mapping left {missing[:3]} unset, {unexpected[:3]} unused")
    return hf


def save_gpt2(model, path: str | Path) -> Path:
    """A folder GPT2LMHeadModel.from_pretrained loads (config.json, model.safetensors)."""
    path = Path(path)
    to_gpt2(model).save_pretrained(path, safe_serialization=True)
    return path


def save_tokenizer(data_dir: str | Path, path: str | Path) -> None:
    """The tokenizer of a prepared data dir as a transformers tokenizer folder (AutoTokenizer
    loads it): a trained bpe:N from its tokenizer.json, gpt2 from GPT-2's own BPE files."""
    import json

    import transformers

    from nlq.data.tokenizers import EOT, gpt2_files

    d = Path(data_dir)
    spec = json.loads((d / "meta.json").read_text()).get("tokenizer")
    if spec == "gpt2":
        files = gpt2_files()
        tok = transformers.GPT2TokenizerFast(vocab_file=str(files["encoder.json"]),
                                             merges_file=str(files["vocab.bpe"]))
    elif (d / "tokenizer.json").is_file():
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"),
                                                   eos_token=EOT, bos_token=EOT)
    else:
        raise NlqError(f"{d} holds no tokenizer to export (meta.json says {spec!r})")
    tok.save_pretrained(path)
