"""nlq.hf.patch_queries on tiny random transformers models (configs built in memory).

GPT-2: the patched HF GPT-2 against nlq's own Transformer holding the same weights (the
inverse of nlq/hf/gpt2.py's mapping, the query module's weights copied across): nlq with
half "explicit" and "fold" must both give HF's logits. Llama: nlq cannot express it
(RMSNorm blocks, SwiGLU MLP), so the patched model is compared with the unpatched one
whose q_proj output is overridden by a hook computing (x + f(x)) / 2 by hand from the
same weights: whole-model logits, two computations of the query.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from nlq.config import ModelConfig
from nlq.errors import NlqError
from nlq.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
from nlq.hf import patch_queries

C, L, NH, V, T = 32, 2, 4, 61, 16
IDX = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))


def randomize(m, seed: int = 1):
    """O(1) weights everywhere (norm gains near 1), so every term moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or name.split(".")[-2].startswith("ln"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:  # Linear (out, in) or Conv1D (in, out): about unit-scale outputs
                p.copy_(noise / min(p.shape) ** 0.5)
    return m.eval()


def gpt2(eps: float = 1e-5):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=NH, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        layer_norm_epsilon=eps)
    return randomize(transformers.GPT2LMHeadModel(cfg))


def llama(cls="Llama", **kw):
    cfg = getattr(transformers, cls + "Config")(
        vocab_size=V, hidden_size=C, intermediate_size=48, num_hidden_layers=L,
        num_attention_heads=NH, num_key_value_heads=2, max_position_embeddings=T, **kw)
    return randomize(getattr(transformers, cls + "ForCausalLM")(cfg))


def nlq_from_gpt2(hf, half: str) -> Transformer:
    """nlq's Transformer with a patched HF GPT-2's weights (nonlinear query)."""
    cfg = ModelConfig(vocab_size=V, block_size=T, n_layer=L, n_head=NH, d_model=C, bias=True,
                      query="nonlinear", query_args={"half": half},
                      norm_eps=hf.config.layer_norm_epsilon)
    ours = Transformer(cfg, seed=0).eval()
    h = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    sd = {k: h[k] for k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(L):
        p, b = f"h.{i}.", f"blocks.{i}."
        kv_w, kv_b = h[p + "attn.c_attn.kv.weight"], h[p + "attn.c_attn.kv.bias"]  # (C, 2C)
        for j, name in enumerate(("attn.k_proj", "attn.v_proj")):
            sd[b + name + ".weight"] = kv_w[:, j * C:(j + 1) * C].T  # (C, C) as nn.Linear
            sd[b + name + ".bias"] = kv_b[j * C:(j + 1) * C]
        for k, v in h.items():
            if k.startswith(p + "attn.c_attn.q."):  # the nlq query module, as it is
                sd[b + "attn.q." + k.removeprefix(p + "attn.c_attn.q.")] = v
        for ours_name, hf_name in (("attn.o_proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                   ("mlp.proj", "mlp.c_proj")):
            sd[b + ours_name + ".weight"] = h[p + hf_name + ".weight"].T  # (out, in)
            sd[b + ours_name + ".bias"] = h[p + hf_name + ".bias"]
        for ln in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"):
            sd[b + ln] = h[p + ln]
    skipped = ours.load_weights(sd, strict=False)
    # only the query's biases may be absent (patched without biases): nlq's stay at zero
    assert all(".attn.q." in k and k.endswith(".bias") for k in skipped), skipped
    return ours


@pytest.mark.parametrize("bias, eps", [(True, 1e-5), (False, 1e-5), (True, 1e-2)])
def test_gpt2_nonlinear_patch_matches_nlq(bias, eps):
    """eps 1e-2: the query's norms take the host's layer_norm_epsilon, as nlq's take its
    norm_eps."""
    hf = gpt2(eps)
    with torch.no_grad():
        before = hf(IDX).logits
        assert patch_queries(hf, "nonlinear", bias=bias) is hf
        for i, block in enumerate(hf.transformer.h):  # f's norms and biases away from init
            randomize(block.attn.c_attn.q, seed=5 + i)
        got = hf(IDX).logits
    assert (got - before).abs().max() > 1e-2  # the query changed the model
    for half in ("explicit", "fold"):
        with torch.no_grad():
            want, _ = nlq_from_gpt2(hf, half)(IDX)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_linear_patch_keeps_gpt2_logits_and_its_kv_cache_works():
    hf = gpt2()
    with torch.no_grad():
        before = hf(IDX).logits
        patch_queries(hf, "linear")
        torch.testing.assert_close(hf(IDX).logits, before, rtol=0, atol=1e-5)
        patch_queries(hf, "nonlinear")  # a patched model patches again (q of FusedQKV)
        # GPT2Attention splits the fused output also when generating with a cache
        cached, plain = (hf.generate(IDX[:, :4], max_new_tokens=8, do_sample=False,
                                     use_cache=c, pad_token_id=0) for c in (True, False))
    assert torch.equal(cached, plain)


@pytest.mark.parametrize("cls,kw", [("Llama", {}), ("Mistral", {}), ("Qwen2", {})])
def test_linear_patch_keeps_llama_family_logits(cls, kw):
    hf = llama(cls, **kw)
    with torch.no_grad():
        before = hf(IDX).logits
        patch_queries(hf, "linear")
        assert torch.equal(hf(IDX).logits, before)


def paper_query(q, x):
    """(x + f(x)) / 2, f = LN(GELU(RMSNorm(x) W1) W2), by hand from q's weights."""
    h = F.rms_norm(x, (C,), q.in_norm.weight, q.in_norm.eps) @ q.w1.weight.T  # (B, T, r)
    f = F.layer_norm(F.gelu(h) @ q.w2.weight.T, (C,), q.out_norm.weight, q.out_norm.bias,
                     q.out_norm.eps)
    return (x + f) / 2


@pytest.mark.parametrize("half", [1.0, 0.5])
def test_llama_nonlinear_patch_matches_a_hand_computed_query(half):
    """half=0.5 is the paper's query; 1.0 (the 1/2 dropped) must not match."""
    ref = llama()
    hf = patch_queries(copy.deepcopy(ref), "nonlinear")
    for i, (layer, patched) in enumerate(zip(ref.model.layers, hf.model.layers)):
        q = randomize(patched.self_attn.q_proj, seed=5 + i)  # the query's norms too
        layer.self_attn.q_proj.register_forward_hook(
            lambda mod, args, out, q=q: 2 * half * paper_query(q, args[0]))
    with torch.no_grad():
        got, want = hf(IDX).logits, ref(IDX).logits
    if half == 0.5:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    else:
        assert (got - want).abs().max() > 1e-2


def test_what_patch_queries_refuses():
    with pytest.raises(NlqError, match="half='explicit'"):
        patch_queries(gpt2(), "nonlinear", half="fold")
    with pytest.raises(NlqError, match="unknown query 'quadratic'"):
        patch_queries(gpt2(), "quadratic")
    with pytest.raises(NlqError, match="does not support Linear"):
        patch_queries(torch.nn.Linear(4, 4))
    with pytest.raises(NlqError, match="head_dim"):
        patch_queries(llama(head_dim=4))  # q_proj: 32 -> 16
