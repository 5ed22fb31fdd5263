"""The transformer and every query variant against a plain reference written from the
formulas (docs/paper.md, "The nonlinear query" and "The other arms"): Q = X W_Q (linear),
Q = X (identity), Q = X + X W_Q (residual), Q = (X + LN(GELU(RMSNorm(X) W1) W2)) / 2
(nonlinear), each with a naive softmax attention at scale 1/sqrt(hs). Every variant in
nlq.model.query.QUERIES is tested: a new one needs its formula in ref_query. Also the init
the paper relies on (f(X) zero mean, unit variance per token).

Legend: B batch, T time, C d_model, nh heads, hs head size. The comparisons run in float64
with randomised weights (norm gains and biases included), so a dropped gain, a wrong scale
or a swapped norm shows up far above the tolerance.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import tiny_model as tiny

from nlq.model.config import ModelConfig
from nlq.model.query import QUERIES
from nlq.model.transformer import Transformer

TOL = {"rtol": 0, "atol": 1e-9}  # float64


@torch.no_grad()
def randomise(model: Transformer, seed: int = 0) -> Transformer:
    """Weights of O(1) effect: gains 1 + noise, biases noise, matrices ~ 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if p.ndim == 1 and name.endswith(".weight"):  # every 1-D weight is a norm gain
            p.copy_(1.0 + 0.2 * noise)
        elif p.ndim == 1:
            p.copy_(0.1 * noise)
        elif name in ("wte.weight", "wpe.weight"):
            p.copy_(noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return randomise(Transformer(cfg).double().eval(), seed)


# ---------------------------------------------------------------------------------------
# the plain reference


def ref_layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * w
    return y if b is None else y + b


def ref_rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_linear(x, lin):
    y = x @ lin.weight.T
    return y if lin.bias is None else y + lin.bias


def ref_act(kind, x):
    if kind == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if kind == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if kind == "silu":
        return x / (1.0 + torch.exp(-x))
    if kind == "tanh":
        return torch.tanh(x)
    raise AssertionError(kind)


def ref_norm(kind, mod, x, eps):
    if kind == "layernorm":
        return ref_layernorm(x, mod.weight, mod.bias, eps)
    if kind == "rmsnorm":
        return ref_rmsnorm(x, mod.weight, eps)
    assert kind == "none"
    return x


def ref_f(cfg: ModelConfig, qmod, x):
    """f(X) = out_norm(act(in_norm(X) W1) W2), its settings read from query_args (the
    paper's where absent)."""
    a = cfg.query_args
    h = ref_norm(a.get("in_norm", "rmsnorm"), qmod.in_norm, x, cfg.norm_eps)
    h = ref_linear(ref_act(a.get("act", "gelu"), ref_linear(h, qmod.w1)), qmod.w2)
    return ref_norm(a.get("out_norm", "layernorm"), qmod.out_norm, h, cfg.norm_eps)


def ref_query(cfg: ModelConfig, qmod, x):
    if cfg.query == "linear":
        return ref_linear(x, qmod.proj)
    if cfg.query == "identity":
        return x
    if cfg.query == "residual":
        return x + ref_linear(x, qmod.proj)
    if cfg.query == "nonlinear":
        return (x + ref_f(cfg, qmod, x)) / 2  # the paper's form, the 1/2 explicit
    raise AssertionError(f"no reference formula for query variant {cfg.query!r}")


def ref_attention(q, k, v, mask, scale):
    """q (B, nh, T, hs), k/v (B, nh, T, hs), mask bool (T, T) True = may attend."""
    out = torch.empty_like(q)
    B, nh, _T, _ = q.shape
    for b in range(B):
        for h in range(nh):
            s = (q[b, h] @ k[b, h].T) * scale  # (T, T)
            s = s.masked_fill(~mask, float("-inf"))
            out[b, h] = torch.softmax(s, dim=-1) @ v[b, h]
    return out


def ref_forward(model: Transformer, idx, mask):
    cfg = model.cfg
    B, T = idx.shape
    nh, hs = cfg.n_head, cfg.head_dim
    x = model.wte.weight[idx]  # (B, T, C)
    if model.wpe is not None:
        x = x + model.wpe.weight[:T]
    for blk in model.blocks:
        h = ref_layernorm(x, blk.ln_1.weight, blk.ln_1.bias, cfg.norm_eps)
        a = blk.attn
        q = ref_query(cfg, a.q, h).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = ref_linear(h, a.k_proj).view(B, T, nh, hs).transpose(1, 2)
        v = ref_linear(h, a.v_proj).view(B, T, nh, hs).transpose(1, 2)
        y = ref_attention(q, k, v, mask, 1.0 / math.sqrt(hs))
        x = x + ref_linear(y.transpose(1, 2).reshape(B, T, -1), a.o_proj)
        h = ref_layernorm(x, blk.ln_2.weight, blk.ln_2.bias, cfg.norm_eps)
        x = x + ref_linear(ref_act("gelu", ref_linear(h, blk.mlp.fc)), blk.mlp.proj)
    x = ref_layernorm(x, model.ln_f.weight, model.ln_f.bias, cfg.norm_eps)
    return ref_linear(x, model.lm_head)


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


IDX = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------
# every query variant against its formula


@pytest.mark.parametrize("query", sorted(QUERIES))
@pytest.mark.parametrize("bias", [False, True])
def test_query_variants_match_formula(query, bias):
    model = build(tiny(query=query, bias=bias))
    with torch.no_grad():
        got, _ = model(IDX)
        want = ref_forward(model, IDX, causal(IDX.shape[1]))
    torch.testing.assert_close(got, want, **TOL)


def test_encoder_matches_reference_with_full_mask():
    model = build(tiny(query="nonlinear", arch="encoder"))
    with torch.no_grad():
        got, _ = model(IDX)
        want = ref_forward(model, IDX, torch.ones(12, 12, dtype=torch.bool))
        wrong = ref_forward(model, IDX, causal(12))
    torch.testing.assert_close(got, want, **TOL)
    assert (got - wrong).abs().max() > 1e-3


def test_fold_and_explicit_half_are_the_same_computation():
    fold = build(tiny(query="nonlinear", query_args={"half": "fold"}))
    explicit = Transformer(dataclasses.replace(fold.cfg, query_args={"half": "explicit"}))
    explicit = explicit.double().eval()
    explicit.load_weights(fold.weights())
    assert fold.blocks[0].attn.scale == pytest.approx(0.5 / math.sqrt(8))
    assert explicit.blocks[0].attn.scale == pytest.approx(1.0 / math.sqrt(8))
    with torch.no_grad():
        a, _ = fold(IDX)
        b, _ = explicit(IDX)
        # the fold really returns X + f(X): twice the explicit query
        x = torch.randn(2, 5, 32, dtype=torch.float64)
        qa, qb = fold.blocks[0].attn.q(x), explicit.blocks[0].attn.q(x)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    torch.testing.assert_close(qa, 2 * qb, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "option",
    [
        {"act": "relu"},
        {"act": "silu"},
        {"act": "gelu_tanh"},
        {"act": "tanh"},
        {"in_norm": "layernorm", "bias": True},
        {"in_norm": "layernorm"},
        {"in_norm": "none"},
        {"out_norm": "rmsnorm"},
        {"out_norm": "none"},
        {"rank": 8},
        {"rank": 1},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_nonlinear_options_match_reference_and_change_output(option):
    default = build(tiny(query="nonlinear", bias=option.get("bias", False)))
    args = {k: v for k, v in option.items() if k != "bias"}  # bias is a [model] key
    model = Transformer(tiny(query="nonlinear", bias=option.get("bias", False),
                             query_args=args)).double().eval()
    randomise(model, seed=5)
    model.load_weights(default.weights(), strict=False)  # same weights wherever they fit
    with torch.no_grad():
        got, _ = model(IDX)
        want = ref_forward(model, IDX, causal(12))
        base, _ = default(IDX)
    torch.testing.assert_close(got, want, **TOL)
    assert (got - base).abs().max() > 1e-4, f"{option} did not change the output"


def test_nonlinear_query_module_has_paper_shapes():
    m = Transformer(tiny(query="nonlinear"))
    q = m.blocks[0].attn.q
    assert q.w1.weight.shape == (16, 32)  # r = C/2 (nn.Linear stores (out, in))
    assert q.w2.weight.shape == (32, 16)
    assert type(q.in_norm).__name__ == "RMSNorm"
    assert isinstance(q.out_norm, torch.nn.LayerNorm)
    # f's weights are exactly C^2 = d^2 (docs/paper.md, "The nonlinear query")
    assert q.w1.weight.numel() + q.w2.weight.numel() == 32 * 32


def test_attn_scale_override_is_used():
    a = build(tiny(query="linear"))
    b = Transformer(dataclasses.replace(a.cfg, attn_scale=0.5)).double().eval()
    b.load_weights(a.weights())
    assert b.blocks[0].attn.scale == 0.5
    c = Transformer(dataclasses.replace(a.cfg, attn_scale=0.5, query="nonlinear")).double()
    assert c.blocks[0].attn.scale == 0.25  # the fold multiplies a given scale too
    with torch.no_grad():
        assert (a(IDX)[0] - b(IDX)[0]).abs().max() > 1e-4
    # attn_scale_mult = 0.5 is the same computation as attn_scale = 0.5 / sqrt(hs)
    d = Transformer(dataclasses.replace(a.cfg, attn_scale_mult=0.5)).double().eval()
    e = Transformer(dataclasses.replace(a.cfg, attn_scale=0.5 / a.cfg.head_dim ** 0.5)).double()
    d.load_weights(a.weights())
    e.load_weights(a.weights())
    assert d.blocks[0].attn.scale == e.blocks[0].attn.scale
    with torch.no_grad():
        assert torch.equal(d(IDX)[0], e.eval()(IDX)[0])
        assert (a(IDX)[0] - d(IDX)[0]).abs().max() > 1e-4


def test_loss_is_mean_cross_entropy_of_logits_ignoring_minus_one():
    model = build(tiny())
    tgt = IDX.clone()
    tgt[0, :3] = -1
    with torch.no_grad():
        logits, _ = model(IDX)
        no_logits, loss = model(IDX, tgt)  # the chunked loss (nlq/model/loss.py)
        _, summed = model(IDX, tgt, reduction="sum")
        plain_logits, plain = model(IDX, tgt, return_logits=True)  # logits + F.cross_entropy
        _, per_token = model(IDX, tgt, reduction="none")
    assert no_logits is None
    torch.testing.assert_close(plain_logits, logits, rtol=0, atol=0)
    lp = torch.log_softmax(logits.double(), -1)
    keep = tgt >= 0
    nll = -lp[keep].gather(-1, tgt[keep][:, None]).squeeze(-1)
    torch.testing.assert_close(loss.double(), nll.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain.double(), nll.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(summed.double(), nll.sum(), rtol=1e-6, atol=1e-6)
    assert per_token.shape == tgt.shape and bool((per_token[~keep] == 0).all())
    torch.testing.assert_close(per_token[keep].double(), nll, rtol=1e-6, atol=1e-6)


def test_sequence_longer_than_block_size_is_an_error():
    model = Transformer(tiny(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------------------------------
# init


def test_init_std_of_residual_and_plain_projections():
    cfg = ModelConfig(vocab_size=100, block_size=16, n_layer=4, n_head=4, d_model=256,
                      mlp_hidden=1024, query="nonlinear", bias=True)
    torch.manual_seed(0)
    m = Transformer(cfg)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    blk = m.blocks[1]
    # 262,144 samples: the relative error of the std estimate is ~0.14%; 3% is safe.
    for w, want in [(blk.mlp.proj.weight, resid), (blk.attn.o_proj.weight, resid),
                    (blk.mlp.fc.weight, 0.02), (blk.attn.k_proj.weight, 0.02),
                    (blk.attn.v_proj.weight, 0.02), (blk.attn.q.w1.weight, 0.02),
                    (blk.attn.q.w2.weight, 0.02), (m.wte.weight, 0.02)]:
        assert w.std().item() == pytest.approx(want, rel=0.03)
        assert abs(w.mean().item()) < 0.1 * want
    for name, p in m.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
    q = blk.attn.q
    assert torch.all(q.out_norm.weight == 1) and torch.all(q.out_norm.bias == 0)
    assert torch.all(q.in_norm.weight == 1)
    assert torch.all(blk.ln_1.weight == 1) and torch.all(blk.ln_1.bias == 0)
    assert m.lm_head.weight is m.wte.weight


@pytest.mark.parametrize("bias", [False, True])
def test_f_at_init_has_zero_mean_unit_variance_per_token(bias):
    # At the paper's width (C = 768) the pre-norm variance of f is ~0.016, far above
    # norm_eps = 1e-5, so LN makes it unit; at C = 64 it is ~1e-4 and eps takes ~10% off.
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=100, block_size=16, n_layer=1, n_head=12,
                                d_model=768, mlp_hidden=64, query="nonlinear", bias=bias))
    q = m.blocks[0].attn.q
    x = torch.randn(3, 10, 768) * 2.0 + 0.5
    with torch.no_grad():
        f = q.f(x)
    torch.testing.assert_close(f.mean(-1), torch.zeros(3, 10), rtol=0, atol=1e-5)
    torch.testing.assert_close(f.var(-1, unbiased=False), torch.ones(3, 10), rtol=0, atol=2e-3)


def test_f_is_invariant_to_positive_rescaling_of_x():
    torch.manual_seed(0)
    m = randomise(Transformer(tiny(query="nonlinear", d_model=64)), seed=3)
    q = m.blocks[0].attn.q
    x = torch.randn(2, 6, 64)
    with torch.no_grad():
        torch.testing.assert_close(q.f(3.7 * x), q.f(x), rtol=1e-4, atol=1e-4)
        assert (q.f(-x) - q.f(x)).abs().max() > 1e-2  # only positive scales
