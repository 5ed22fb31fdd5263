"""Attention against a naive softmax(Q K^T * scale + mask) V for every masking pattern
(causal, bidirectional, prefix-LM, an arbitrary boolean mask), grouped-query attention
against MHA with repeated K/V heads, causality of the decoder, and RoPE.

Legend: B batch, T time, C d_model, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import tiny_model as tiny

from nlq.model.query import QUERIES
from nlq.model.transformer import Attention, Transformer, apply_rope, prefix_lm_mask, rope_cache

TOL = {"rtol": 0, "atol": 1e-10}  # float64
VARIANTS = sorted(QUERIES)  # every registered query variant


@torch.no_grad()
def randomise(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1) weights so attention is far from uniform and masks matter."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        p.copy_(1.0 + 0.2 * noise if p.ndim == 1 else noise / math.sqrt(p.shape[-1]))
    return module


def model(seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return randomise(Transformer(tiny(**kw)).double().eval(), seed)


def attention(seed=0, **kw) -> Attention:
    torch.manual_seed(seed)
    return randomise(Attention(tiny(**kw)).double().eval(), seed)


def naive_attention(attn: Attention, x, mask, rope=None):
    """softmax(Q K^T * scale + mask) V, K/V heads repeated per group, then o_proj.
    mask: bool broadcastable to (B, nh, T, T), True = may attend."""
    B, T, C = x.shape
    nh, nkv, hs = attn.nh, attn.nkv, attn.hs
    q = attn.q(x).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
    k = (x @ attn.k_proj.weight.T).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
    v = (x @ attn.v_proj.weight.T).view(B, T, nkv, hs).transpose(1, 2)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k = k.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, hs): head h uses kv head h // g
    v = v.repeat_interleave(nh // nkv, dim=1)
    add = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float("-inf"))
    att = torch.softmax(q @ k.transpose(-1, -2) * attn.scale + add, dim=-1)  # (B, nh, T, T)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)
    return y @ attn.o_proj.weight.T


X = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
T = X.shape[1]


def loop_prefix_mask(T, p):
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            m[i, j] = j <= i or (i < p and j < p)
    return m


@pytest.mark.parametrize("query", VARIANTS)
def test_causal_matches_naive(query):
    a = attention(query=query)
    with torch.no_grad():
        got = a(X, is_causal=True)
        want = naive_attention(a, X, torch.ones(T, T, dtype=torch.bool).tril())
        full = naive_attention(a, X, torch.ones(T, T, dtype=torch.bool))
    torch.testing.assert_close(got, want, **TOL)
    assert (got - full).abs().max() > 1e-3  # the mask matters for this input


def test_bidirectional_matches_naive():
    a = attention(query="nonlinear")
    with torch.no_grad():
        got = a(X)
        want = naive_attention(a, X, torch.ones(T, T, dtype=torch.bool))
    torch.testing.assert_close(got, want, **TOL)


def test_prefix_lm_mask_matches_loop_definition():
    for p in (0, 1, 4, T):
        assert torch.equal(prefix_lm_mask(T, p), loop_prefix_mask(T, p)), p
    per = prefix_lm_mask(T, torch.tensor([0, 3, 7]))
    assert per.shape == (3, 1, T, T)
    for b, p in enumerate((0, 3, 7)):
        assert torch.equal(per[b, 0], loop_prefix_mask(T, p))


@pytest.mark.parametrize("prefix", [4, "tensor"])
def test_prefix_lm_attention_matches_naive(prefix):
    a = attention(query="nonlinear")
    lens = [2, 5, 9]
    if prefix == "tensor":
        mask = prefix_lm_mask(T, torch.tensor(lens))
        want_mask = torch.stack([loop_prefix_mask(T, p) for p in lens])[:, None]  # (B, 1, T, T)
    else:
        mask = prefix_lm_mask(T, prefix)
        want_mask = loop_prefix_mask(T, prefix)
    with torch.no_grad():
        got = a(X, mask=mask)
        want = naive_attention(a, X, want_mask)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("query", VARIANTS)
def test_arbitrary_bool_mask_matches_naive(query):
    a = attention(query=query)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 1, T, T, generator=g) < 0.4
    mask |= torch.eye(T, dtype=torch.bool)  # every row attends somewhere
    with torch.no_grad():
        got = a(X, mask=mask)
        want = naive_attention(a, X, mask)
    torch.testing.assert_close(got, want, **TOL)
    # a per-head mask (B, nh, T, T) too
    mask_h = (torch.rand(3, 4, T, T, generator=g) < 0.3) | torch.eye(T, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(a(X, mask=mask_h), naive_attention(a, X, mask_h), **TOL)


# ---------------------------------------------------------------------------------------
# the masks as the Transformer picks them


IDX = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(2))


def test_decoder_default_equals_explicit_causal_mask():
    m = model(query="nonlinear")
    with torch.no_grad():
        a, _ = m(IDX)
        b, _ = m(IDX, attn_mask=torch.ones(T, T, dtype=torch.bool).tril())
        c, _ = m(IDX, attn_mask=torch.ones(T, T, dtype=torch.bool))
    torch.testing.assert_close(a, b, **TOL)
    assert (a - c).abs().max() > 1e-3


def test_encoder_default_equals_full_mask():
    m = model(query="nonlinear", arch="encoder")
    with torch.no_grad():
        a, _ = m(IDX)
        b, _ = m(IDX, attn_mask=torch.ones(T, T, dtype=torch.bool))
    torch.testing.assert_close(a, b, **TOL)


def test_prefix_arch_per_batch_prefix_equals_per_sample_int_prefix():
    m = model(query="nonlinear", arch="prefix")
    lens = [0, 3, 7]
    with torch.no_grad():
        batched, _ = m(IDX, prefix_len=torch.tensor(lens))
        for b, p in enumerate(lens):
            one, _ = m(IDX[b : b + 1], prefix_len=p)
            explicit, _ = m(IDX[b : b + 1], attn_mask=loop_prefix_mask(T, p))
            torch.testing.assert_close(batched[b : b + 1], one, **TOL)
            torch.testing.assert_close(one, explicit, **TOL)
        plain, _ = m(IDX)  # no prefix_len: plain causal
        zero, _ = m(IDX, prefix_len=0)
    torch.testing.assert_close(plain, zero, **TOL)
    assert (batched[2] - plain[2]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------
# causality


@pytest.mark.parametrize("query", VARIANTS)
@pytest.mark.parametrize("pos_emb", ["learned", "rope", "none"])
def test_decoder_is_causal(query, pos_emb):
    m = model(query=query, pos_emb=pos_emb, qk_norm=pos_emb == "rope")
    idx2 = IDX.clone()
    t = 4
    idx2[:, t + 1] = (idx2[:, t + 1] + 1) % 100
    with torch.no_grad():
        a, _ = m(IDX)
        b, _ = m(idx2)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-12)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-4


def test_encoder_is_not_causal():
    m = model(query="nonlinear", arch="encoder")
    idx2 = IDX.clone()
    idx2[:, 5] = (idx2[:, 5] + 1) % 100
    with torch.no_grad():
        a, _ = m(IDX)
        b, _ = m(idx2)
    assert (a[:, :5] - b[:, :5]).abs().amax(-1).min() > 1e-4  # every earlier position moves


def test_prefix_is_bidirectional_inside_the_prefix_only():
    m = model(query="nonlinear", arch="prefix")
    p = 6
    inside, after = IDX.clone(), IDX.clone()
    inside[:, 4] = (inside[:, 4] + 1) % 100
    after[:, 7] = (after[:, 7] + 1) % 100
    with torch.no_grad():
        a, _ = m(IDX, prefix_len=p)
        b, _ = m(inside, prefix_len=p)
        c, _ = m(after, prefix_len=p)
    assert (a[:, :4] - b[:, :4]).abs().max() > 1e-4
    torch.testing.assert_close(a[:, :7], c[:, :7], rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------
# grouped-query attention


def test_gqa_with_n_kv_head_equal_n_head_is_mha():
    mha = model(query="nonlinear")
    gqa = Transformer(dataclasses.replace(mha.cfg, n_kv_head=4)).double().eval()
    gqa.load_weights(mha.weights())
    with torch.no_grad():
        torch.testing.assert_close(gqa(IDX)[0], mha(IDX)[0], **TOL)


def _repeat_kv(w, nkv, nh, interleave=True):
    hs = w.shape[0] // nkv
    w = w.view(nkv, hs, -1)  # (nkv, hs, C)
    w = w.repeat_interleave(nh // nkv, 0) if interleave else w.repeat(nh // nkv, 1, 1)
    return w.reshape(nh * hs, -1)


@pytest.mark.parametrize("nkv", [1, 2])
@pytest.mark.parametrize("query", VARIANTS)
def test_gqa_equals_mha_with_repeated_kv_heads(nkv, query):
    gqa = model(query=query, n_kv_head=nkv, pos_emb="rope")
    assert gqa.blocks[0].attn.k_proj.weight.shape == (nkv * 8, 32)

    def as_mha(interleave):
        sd = gqa.weights()
        for k in list(sd):
            if k.endswith(("k_proj.weight", "v_proj.weight")):
                sd[k] = _repeat_kv(sd[k], nkv, 4, interleave)
        mha = Transformer(dataclasses.replace(gqa.cfg, n_kv_head=None)).double().eval()
        mha.load_weights(sd)
        return mha

    with torch.no_grad():
        got, _ = gqa(IDX)
        want, _ = as_mha(True)(IDX)
        torch.testing.assert_close(got, want, **TOL)
        if nkv > 1:  # the other grouping (head h -> kv head h % nkv) is a different model
            other, _ = as_mha(False)(IDX)
            assert (got - other).abs().max() > 1e-4


def test_gqa_attention_matches_naive_with_mask():
    a = attention(query="nonlinear", n_kv_head=2)
    mask = (torch.rand(3, 1, T, T, generator=torch.Generator().manual_seed(4)) < 0.5)
    mask |= torch.eye(T, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(a(X, mask=mask), naive_attention(a, X, mask), **TOL)


# ---------------------------------------------------------------------------------------
# rotary embeddings


def naive_rope(x, base=10000.0):
    """Complex form: pair j = (x[j], x[j + hs/2]) rotated by pos * base^(-2j/hs)."""
    *_, T, hs = x.shape
    half = hs // 2
    z = torch.complex(x[..., :half], x[..., half:])
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / hs)
    rot = torch.polar(torch.ones(T, half, dtype=torch.float64),
                      torch.arange(T, dtype=torch.float64)[:, None] * theta)  # (T, hs/2)
    z = z * rot
    return torch.cat((z.real, z.imag), dim=-1)


def test_rope_matches_complex_reference():
    cfg = tiny(pos_emb="rope", rope_base=500.0)
    cos, sin = rope_cache(cfg)
    x = torch.randn(2, 4, 12, 8, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), naive_rope(x, 500.0), rtol=0, atol=1e-5)


def test_rope_scores_depend_only_on_relative_offset():
    cfg = tiny(pos_emb="rope", block_size=32)
    cos, sin = rope_cache(cfg)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, generator=g).expand(1, 1, 32, 8)  # the same vector at every position
    k = torch.randn(8, generator=g).expand(1, 1, 32, 8)
    s = (apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2))[0, 0]  # (T, T)
    for off in (-5, 0, 3, 9):
        d = torch.diagonal(s, offset=off)
        torch.testing.assert_close(d, d[:1].expand_as(d), rtol=0, atol=1e-4)
    assert (s[0, 1] - s[0, 5]).abs() > 1e-3  # but it does depend on the offset
    torch.testing.assert_close(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1))


def test_rope_attention_matches_naive():
    a = attention(query="nonlinear", pos_emb="rope")
    rope = rope_cache(tiny(pos_emb="rope"))
    with torch.no_grad():
        got = a(X, is_causal=True, rope=rope)
        want = naive_attention(a, X, torch.ones(T, T, dtype=torch.bool).tril(), rope=rope)
        no_rope = a(X, is_causal=True)
    torch.testing.assert_close(got, want, **TOL)
    assert (got - no_rope).abs().max() > 1e-3


def test_qk_norm_normalises_each_head():
    a = attention(query="linear", qk_norm=True)
    with torch.no_grad():
        a.q_norm.weight.fill_(1.0)
        a.k_norm.weight.fill_(1.0)
        B, nh, hs = 3, a.nh, a.hs

        def split(t):
            return t.view(B, T, nh, hs).transpose(1, 2)

        q = split(a.q(X))
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + 1e-5)
        k = split(X @ a.k_proj.weight.T)
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + 1e-5)
        v = split(X @ a.v_proj.weight.T)
        att = torch.softmax(q @ k.transpose(-1, -2) * a.scale, -1)
        want = (att @ v).transpose(1, 2).reshape(B, T, -1) @ a.o_proj.weight.T
        torch.testing.assert_close(a(X), want, **TOL)


@pytest.mark.parametrize("kw", [{}, {"qk_norm": True, "attn_scale_mult": 2.0},
                                {"n_kv_head": 2, "query": "nonlinear"}, {"pos_emb": "rope"}])
@pytest.mark.parametrize("masking", ["causal", "bidirectional", "mask"])
def test_logits_are_the_ones_forward_softmaxes(kw, masking):
    """Attention.logits (the logit-range measurement) is the forward's math: softmax of its
    logits over the allowed positions times V, through o_proj, equals forward."""
    attn = attention(**kw)
    B, T, C = 2, 16, 32
    x = torch.randn(B, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rope = None
    if kw.get("pos_emb") == "rope":
        rope = tuple(t.double() for t in rope_cache(tiny(**kw)))
    mask = prefix_lm_mask(T, 5) if masking == "mask" else None
    causal = masking == "causal"
    logits, allowed = attn.logits(x, mask, causal, rope)  # (B, nh, T, T)
    p = logits.double().masked_fill(~allowed, float("-inf")).softmax(-1)
    v = attn.v_proj(x).view(B, T, attn.nkv, attn.hs).transpose(1, 2)  # (B, nkv, T, hs)
    v = v.repeat_interleave(attn.nh // attn.nkv, dim=1)  # (B, nh, T, hs)
    y = (p @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    torch.testing.assert_close(attn.o_proj(y), attn(x, mask, causal, rope), rtol=0, atol=1e-6)


def test_the_qknorm_arms_share_one_logit_scale():
    """linear-qknorm and nonlinear-qknorm differ in the query only: the same attention scale
    (a folded 1/2 of the nonlinear query would halve its normalised logits), twice the
    1/sqrt(hs) of linear-qknorm-x1."""
    from nlq.experiments.experiment import experiment_arms, load_experiment

    exp = load_experiment("strong-baseline")
    cfgs = experiment_arms(exp, "small", names=["linear-qknorm", "nonlinear-qknorm"])
    scales = {a: Transformer(c.model, seed=0).blocks[0].attn.scale for a, c in cfgs.items()}
    hs = cfgs["linear-qknorm"].model.head_dim
    assert scales == {"linear-qknorm": 2 / math.sqrt(hs), "nonlinear-qknorm": 2 / math.sqrt(hs)}
