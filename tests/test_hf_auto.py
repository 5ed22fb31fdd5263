"""Every arm as a transformers model of model_type "nlq" (nlq.hf.auto): a folder written from
an nlq model loads through the Auto classes with nlq's logits and loss, in this process and
in a fresh one that only ran `import nlq.hf`; `nlq convert --to hf` writes such a folder."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import o1_model

from nlq.cli import main
from nlq.config import ModelConfig
from nlq.errors import NlqError
from nlq.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
from nlq.hf.auto import NlqConfig, NlqForCausalLM, NlqForMaskedLM, register, save_hf, to_hf

V, T = 97, 24
IDX = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))
ARMS = {
    "linear": {},
    "identity": {"query": "identity"},
    "residual": {"query": "residual", "bias": True, "tie_embeddings": False},
    "nonlinear": {"query": "nonlinear"},
    "nonlinear-explicit": {"query": "nonlinear", "query_args": {"half": "explicit"},
                           "bias": True},
    "linear-qk_norm-rope": {"qk_norm": True, "pos_emb": "rope"},
    "nonlinear-qk_norm-rope-gqa": {"query": "nonlinear", "qk_norm": True, "pos_emb": "rope",
                                   "n_kv_head": 2},
    "prefix-nonlinear": {"arch": "prefix", "query": "nonlinear"},
}


def model(**kw) -> Transformer:
    return o1_model(V, T, **kw)


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_loads_through_the_auto_classes_with_nlq_logits(arm, tmp_path):
    ours = model(**ARMS[arm])
    with torch.no_grad():
        want, _ = ours(IDX)
        _, want_loss = ours(IDX[:, :-1], IDX[:, 1:])
        assert (to_hf(ours)(IDX).logits - want).abs().max() <= 1e-5
        save_hf(ours, tmp_path / "m")
        config = transformers.AutoConfig.from_pretrained(tmp_path / "m")
        assert isinstance(config, NlqConfig) and config.nlq_config() == ours.cfg
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        assert isinstance(hf, NlqForCausalLM)
        out = hf(IDX, labels=IDX)  # HF convention: labels shifted inside
    assert want.abs().max() > 1.0  # non-trivial logits
    assert (out.logits - want).abs().max() <= 1e-5
    assert abs(out.loss - want_loss) <= 1e-5
    tied = hf.model.lm_head.weight is hf.model.wte.weight
    assert tied == ours.cfg.tie_embeddings
    if ours.cfg.arch == "prefix":  # bidirectional over the first 8 tokens
        with torch.no_grad():
            got = hf(IDX, prefix_len=8).logits
        assert (got - ours(IDX, prefix_len=8)[0]).abs().max() <= 1e-5


def test_an_encoder_loads_as_a_masked_lm_and_its_padding_mask_hides_pads(tmp_path):
    ours = model(arch="encoder", query="nonlinear")
    save_hf(ours, tmp_path / "enc")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "enc").eval()
    assert isinstance(hf, NlqForMaskedLM)
    labels = torch.full_like(IDX, -100)
    labels[:, ::5] = IDX[:, ::5]
    padded = torch.cat([IDX[:, :16], torch.zeros(3, 8, dtype=torch.long)], 1)  # (B, T)
    mask = torch.ones_like(padded)
    mask[:, 16:] = 0
    with torch.no_grad():
        want, _ = ours(IDX)
        out = hf(IDX, labels=labels)
        short, _ = ours(IDX[:, :16])  # bidirectional: pads would change every position
        masked = hf(padded, attention_mask=mask).logits[:, :16]
    assert (out.logits - want).abs().max() <= 1e-5
    keep = labels != -100
    assert abs(out.loss - F.cross_entropy(want[keep], labels[keep])) <= 1e-5
    assert (masked - short).abs().max() <= 1e-5
    with pytest.raises(NlqError, match="AutoModelForMaskedLM"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "enc")


def test_left_padding_with_rope_gives_the_unpadded_logits_and_generate_is_greedy():
    ours = model(query="nonlinear", pos_emb="rope")
    hf = to_hf(ours)
    padded = torch.cat([torch.zeros(3, 6, dtype=torch.long), IDX[:, :18]], 1)  # (B, T)
    mask = torch.ones_like(padded)
    mask[:, :6] = 0
    with torch.no_grad():
        short, _ = ours(IDX[:, :18])  # RoPE is relative: the 6 hidden pads shift nothing
        masked = hf(padded, attention_mask=mask).logits[:, 6:]
        got = hf.generate(IDX[:, :4], attention_mask=torch.ones(3, 4, dtype=torch.long),
                          max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert (masked - short).abs().max() <= 1e-5
    assert torch.equal(got, ours.generate(IDX[:, :4], 8, temperature=0))


def test_left_padding_with_learned_positions_numbers_the_real_tokens_from_zero():
    """generate pads a decoder's batch on the left: with a learned position table the real
    tokens must still sit at positions 0.. (they sat at 6.. and the logits moved by ~3)."""
    ours = model(query="nonlinear")
    assert ours.wpe is not None
    hf = to_hf(ours)
    padded = torch.cat([torch.zeros(3, 6, dtype=torch.long), IDX[:, :18]], 1)  # (B, T)
    mask = torch.ones_like(padded)
    mask[:, :6] = 0
    with torch.no_grad():
        short, _ = ours(IDX[:, :18])
        masked = hf(padded, attention_mask=mask).logits[:, 6:]
    assert (masked - short).abs().max() <= 1e-5


def test_register_is_idempotent_and_maps_the_config_to_the_models():
    register()
    register()
    config = NlqConfig.from_nlq(ModelConfig(vocab_size=V, block_size=T, n_layer=1, n_head=2,
                                            d_model=16, query="nonlinear"))
    assert isinstance(transformers.AutoConfig.for_model("nlq"), NlqConfig)
    assert isinstance(transformers.AutoModelForCausalLM.from_config(config), NlqForCausalLM)
    assert config.hidden_size == 16 and config.num_hidden_layers == 1  # HF's common names


def test_nlq_convert_to_hf_from_a_checkpoint_loads_in_a_fresh_process(tmp_path):
    from nlq.run.checkpoint import save

    ours = model(query="nonlinear", pos_emb="rope", qk_norm=True)
    state = {"tokens": 0, "elapsed": 0.0, "metrics_bytes": 0, "param_groups": [],
             "model_config": dataclasses.asdict(ours.cfg)}
    ckpt = save(tmp_path / "run", 7, ours.weights(), {}, state, keep=1)
    assert main(["convert", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    torch.save(IDX, tmp_path / "idx.pt")
    code = ("import sys, torch, transformers, nlq.hf; d = sys.argv[1]; "
            "m = transformers.AutoModelForCausalLM.from_pretrained(d + '/hf').eval(); "
            "torch.save(m(torch.load(d + '/idx.pt')).logits.detach(), d + '/logits.pt')")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=300)
    with torch.no_grad():
        want, _ = ours(IDX)
    assert (torch.load(tmp_path / "logits.pt") - want).abs().max() <= 1e-5
    # nlq's own readers (nlq eval, nlq sample) take the folder too, with its step
    from nlq.infer.load import load_trained

    got = load_trained(tmp_path / "hf")
    assert got.step == 7
    with torch.no_grad():
        assert (got.model(IDX)[0] - want).abs().max() <= 1e-5
