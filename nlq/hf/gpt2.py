"""nlq's linear arm is GPT-2 (tests/test_model_hf_parity.py): its weights as a
`transformers.GPT2LMHeadModel` with the same logits, in memory or as a folder that
`GPT2LMHeadModel.from_pretrained` loads. The name and layout map is names.py's (one map for
both directions); a model without biases gets zero biases (HF GPT-2 always has them)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from nlq.errors import NlqError
from nlq.hf.names import is_buffer, to_hf


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
        (cfg.query_args.get("out_norm", "none") != "none",
         "a normalised query (query_args.out_norm; GPT-2 has none)"),
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
    """nlq weights -> GPT2LMHeadModel's state dict names and layouts, in their own memory."""
    return {k: v.detach().clone() for k, v in to_hf(model.state_dict(), model.cfg.n_layer).items()}


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
    missing = [k for k in missing if not is_buffer(k)]
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
