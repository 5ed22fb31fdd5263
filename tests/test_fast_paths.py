"""The CPU fast paths against the plain computations they replace (benchmarks/RESULTS.md,
the train_bench section on the CPU fast paths, says why they exist).

- nlq/model/loss.py: the chunked output-projection + cross-entropy vs F.cross_entropy on
  materialised logits (values and gradients, float64, several chunkings, ignored rows, bf16
  autocast, a whole model's training step with tied embeddings);
- nlq/model/fast.py (apply_fast_paths, the one switch) and the kernels it swaps in
  (nlq/model/kernels.py): RMSNorm's and the nonlinear query's hand-written CPU backward vs
  the plain modules (a copy of the same module, not swapped) and gradcheck, and a whole
  training step of every query variant with the switch on vs off;
- nlq/train/alloc.py: the allocator tuning is applied and changes no result.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import nlq.model.loss as L
from nlq.model import kernels
from nlq.model.config import ModelConfig
from nlq.model.fast import FastNonlinearQuery, FastRMSNorm, apply_fast_paths
from nlq.model.layers import RMSNorm
from nlq.model.query import QUERIES, NonlinearQuery, make_query
from nlq.model.transformer import Transformer


def plain_ce(h, w, y, reduction):
    return F.cross_entropy((h @ w.t()).to(torch.promote_types(h.dtype, torch.float32)), y,
                           ignore_index=-1, reduction=reduction)


def grads(loss, *xs):
    return torch.autograd.grad(loss, xs, retain_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])  # one row, uneven, even, one chunk
def test_chunked_loss_matches_cross_entropy_float64(monkeypatch, reduction, rows):
    monkeypatch.setattr(L, "chunk_rows", lambda n, v, d: rows)
    g = torch.Generator().manual_seed(0)
    N, C, V = 130, 24, 97
    h = torch.randn(N, C, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, C, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = -1  # ignored rows carry no loss and no gradient
    got = L.linear_cross_entropy(h, w, y, reduction)
    want = plain_ce(h, w, y, reduction)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(got * 1.7, h, w), grads(want * 1.7, h, w)):  # g != 1 reaches both
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert grads(got, h)[0][::5].abs().max() == 0


def test_chunked_loss_with_every_row_ignored_is_zero_mean_and_zero_sum():
    """No target (a masked-LM micro-batch that masked nothing): a loss of 0 with zero
    gradients, where F.cross_entropy's mean is NaN (0/0)."""
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(11, 8)
    y = torch.full((4,), -1)
    assert torch.isnan(plain_ce(h, w, y, "mean"))
    for reduction in ("mean", "sum"):
        s = L.linear_cross_entropy(h, w, y, reduction)
        assert s.item() == 0.0 and grads(s, h)[0].abs().max() == 0


def test_chunked_loss_rejects_other_reductions():
    with pytest.raises(ValueError, match="reduction"):
        L.linear_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long),
                               "none")


def test_chunk_rows_budget_and_floor():
    cpu = torch.device("cpu")
    assert L.chunk_rows(2048, 8192, cpu) == L.CHUNK_ELEMENTS["cpu"] // 8192
    assert L.chunk_rows(4096, 50304, cpu) == L.MIN_CHUNK_ROWS  # the floor beats the budget
    assert L.chunk_rows(100, 50304, cpu) == 100  # never more rows than there are
    assert L.chunk_rows(10**6, 1 << 30, torch.device("meta")) == L.MIN_CHUNK_ROWS


def test_chunked_loss_under_bf16_autocast_matches_the_plain_autocast_path():
    torch.manual_seed(0)
    h = torch.randn(300, 32, requires_grad=True)
    w = (0.3 * torch.randn(50, 32)).requires_grad_()
    y = torch.randint(0, 50, (300,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.linear_cross_entropy(h, w, y)
        want = F.cross_entropy((h @ w.t()).float(), y)  # bf16 matmul, fp32 softmax
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    gh, gw = grads(got, h, w)
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    for a, b in zip((gh, gw), grads(want, h, w)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_model_gradients_equal_with_and_without_logits(tied, arch):
    """A training step's gradients through the chunked loss == through logits + F.cross_entropy
    (tied: the head's gradient adds into the embedding's)."""
    cfg = ModelConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, d_model=16,
                      mlp_hidden=32, query="nonlinear", tie_embeddings=tied, arch=arch)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    idx = torch.randint(0, 61, (3, 16))
    tgt = torch.randint(0, 61, (3, 16))
    tgt[:, ::3] = -1
    out = {}
    for rl in (False, True):
        model.zero_grad(set_to_none=True)
        logits, loss = model(idx, tgt, return_logits=rl)
        assert (logits is None) != rl
        loss.backward()
        out[rl] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out[False][0], out[True][0], rtol=1e-12, atol=1e-12)
    for n, g in out[True][1].items():
        torch.testing.assert_close(out[False][1][n], g, rtol=1e-9, atol=1e-12, msg=n)


# -- RMSNorm ----------------------------------------------------------------------------


def test_rmsnorm_cpu_backward_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: kernels.RMSNormCPU.apply(a, b, 1e-5), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rmsnorm_cpu_path_matches_plain_path(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
    x = (3 * torch.randn(4, 10, 64, dtype=dtype)).requires_grad_()
    up = torch.randn(4, 10, 64, dtype=dtype)
    fast = apply_fast_paths(copy.deepcopy(norm))
    assert type(fast) is FastRMSNorm and type(norm) is RMSNorm
    got = fast(x)
    want = norm(x)  # the plain path: F.rms_norm
    assert got.grad_fn.name() == "RMSNormCPUBackward"  # the kernel did run
    assert "RMSNormCPU" not in want.grad_fn.name()
    torch.testing.assert_close(want, F.rms_norm(x, (64,), norm.weight, 1e-5), rtol=0, atol=0)
    tol = ({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32
           else {"rtol": 1e-12, "atol": 1e-12})
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(grads((got * up).sum(), x, fast.weight),
                    grads((want * up).sum(), x, norm.weight)):
        torch.testing.assert_close(a, b, **tol)


def test_apply_fast_paths_swaps_classes_only():
    """The switch changes which forward runs, nothing else: the same parameter names, shapes
    and values, the same state dict; only the exact plain classes are swapped (a subclass
    with a forward of its own keeps it), and applying it twice changes nothing more."""
    cfg = ModelConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, d_model=16,
                      mlp_hidden=32, query="nonlinear", qk_norm=True)
    plain = Transformer(cfg, seed=3)
    fast = apply_fast_paths(Transformer(cfg, seed=3))
    assert apply_fast_paths(fast) is fast
    kinds = {type(m) for m in fast.modules()}
    assert {FastRMSNorm, FastNonlinearQuery} <= kinds and not {RMSNorm, NonlinearQuery} & kinds
    assert not {FastRMSNorm, FastNonlinearQuery} & {type(m) for m in plain.modules()}
    a, b = plain.state_dict(), fast.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    class Own(NonlinearQuery):  # a registered variant built on the nonlinear query
        def forward(self, x):
            return 3 * x

    own = apply_fast_paths(Own(d_model=16))
    assert type(own) is Own and type(own.in_norm) is FastRMSNorm


# float64: the two paths agree to rounding; float32 (what training runs): to float32's
TOLERANCES = {torch.float64: {"rtol": 1e-9, "atol": 1e-12},
              torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("query", sorted(QUERIES))
def test_model_step_with_fast_paths_equals_plain_path(query, dtype):
    """A whole training step (QK-norm on, so RMSNorm's kernel runs in every variant): loss
    and every parameter's gradient of the model after apply_fast_paths == of the plain
    model with the same weights."""
    cfg = ModelConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, d_model=16,
                      mlp_hidden=32, query=query, qk_norm=True)
    torch.manual_seed(0)
    plain = Transformer(cfg).to(dtype)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.3 * torch.randn_like(p))  # gains away from 1, so a dropped gain shows
    fast = apply_fast_paths(copy.deepcopy(plain))
    idx = torch.randint(0, 61, (3, 16))
    out = {}
    for name, model in (("fast", fast), ("plain", plain)):
        _, loss = model(idx, idx)
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out["fast"][0], out["plain"][0], **tol)
    for n, g in out["plain"][1].items():
        torch.testing.assert_close(out["fast"][1][n], g, **tol, msg=n)


# -- allocator tuning -------------------------------------------------------------------


def test_allocator_tuning_applies_on_glibc_and_changes_no_result():
    """Same model, same step before and after mallopt: bitwise equal (it moves memory only)."""
    from nlq.train import alloc

    cfg = ModelConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, d_model=16, mlp_hidden=32)

    def step():
        torch.manual_seed(0)
        m = Transformer(cfg)
        _, loss = m(torch.arange(8)[None] % 50, torch.arange(1, 9)[None] % 50)
        loss.backward()
        return loss.detach(), m.wte.weight.grad

    before = step()
    applied = alloc.keep_freed_memory()
    after = step()
    assert alloc.keep_freed_memory() == applied  # idempotent
    import platform

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert applied
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])



# -- no copies around the head reshape ----------------------------------------------------


@pytest.mark.parametrize("query", ["linear", "nonlinear"])
def test_attention_forward_makes_no_copies_around_the_head_reshape(query):
    """(B, T, C) -> (B, nh, T, hs) and back are views: SDPA's CPU kernel writes its output in
    (B, T, nh, hs) memory order, so the transpose back is contiguous and reshape copies
    nothing. A copy would show up as aten::copy_ / clone / contiguous in the profile."""
    from nlq.model.transformer import Attention

    cfg = ModelConfig(vocab_size=50, block_size=32, n_layer=1, n_head=4, d_model=64,
                      mlp_hidden=128, query=query)
    attn = Attention(cfg)
    x = torch.randn(2, 32, 64)
    with torch.no_grad(), torch.profiler.profile(record_shapes=True) as prof:
        attn(x, is_causal=True)
    copies = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"}
    seen = [(e.key, e.input_shapes) for e in prof.key_averages(group_by_input_shape=True)]
    assert any(k == "aten::_scaled_dot_product_flash_attention_for_cpu" for k, _ in seen)
    big = [(k, sh) for k, sh in seen if k in copies
           and any(math.prod(d) >= 2 * 32 for d in sh if isinstance(d, list) and d)]
    assert not big, big  # (scalar conversions inside the norms are fine)

def test_chunked_loss_without_grad_skips_the_gradient_work(monkeypatch):
    """Under no_grad (eval) the loss is the same and no gradient is formed."""
    calls = []
    real = L._sum_nats
    monkeypatch.setattr(L, "_sum_nats", lambda *a, **k: calls.append(k["grad"]) or real(*a, **k))
    h = torch.randn(40, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    y = torch.randint(0, 30, (40,))
    with torch.no_grad():
        a = L.linear_cross_entropy(h, w, y, "sum")
    b = L.linear_cross_entropy(h, w, y, "sum")
    assert calls == [False, True]
    assert a.grad_fn is None and b.grad_fn is not None
    torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


# -- the nonlinear query's fused CPU path --------------------------------------------------


def _nlq_args(C=8, r=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    def t(*shape):
        return torch.randn(*shape, dtype=dtype, generator=g, requires_grad=True)
    return t(3, 5, C), 1 + 0.3 * t(C), t(r, C), t(C, r), 1 + 0.3 * t(C)


@pytest.mark.parametrize("approx", ["none", "tanh"])
def test_fused_nonlinear_query_passes_gradcheck(approx):
    x, g, w1, w2, ln_w = _nlq_args()
    args = tuple(a.detach().requires_grad_() for a in (x, g, w1, w2, ln_w))
    assert torch.autograd.gradcheck(
        lambda *a: kernels.NonlinearQueryCPU.apply(*a, None, 1e-5, 1e-5, approx), args)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_nonlinear_query_matches_the_modules(monkeypatch, dtype, act):
    """The fused CPU path == RMSNorm, nn.Linear, GELU, nn.Linear, LayerNorm modules plus X:
    values and the gradients of X and of every parameter."""
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layer=1, n_head=4, d_model=32,
                      mlp_hidden=64, query="nonlinear", query_args={"act": act})
    torch.manual_seed(0)
    plain = make_query(cfg).to(dtype)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.3 * torch.randn_like(p))  # gains away from 1, so a dropped gain shows
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)
    up = torch.randn(2, 16, 32, dtype=dtype)
    out = {}
    for fast, q in ((True, apply_fast_paths(copy.deepcopy(plain))), (False, plain)):
        assert (type(q) is FastNonlinearQuery) == fast
        y = q(x)
        assert (y.grad_fn.name() == "NonlinearQueryCPUBackward") == fast
        gs = torch.autograd.grad((y * up).sum(), [x, *q.parameters()])
        out[fast] = (y, gs)
    tol = ({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32
           else {"rtol": 1e-11, "atol": 1e-11})
    torch.testing.assert_close(out[True][0], out[False][0], **tol)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, **tol)


def test_fused_nonlinear_query_only_where_it_applies():
    base = {"vocab_size": 50, "block_size": 16, "n_layer": 1, "n_head": 4, "d_model": 32,
            "mlp_hidden": 64, "query": "nonlinear"}
    x = torch.randn(1, 4, 32)

    def fast(**kw):
        return apply_fast_paths(make_query(ModelConfig(**base, **kw)))

    assert type(fast()) is FastNonlinearQuery and fast().fused_cpu(x)
    assert type(fast(bias=True)) is NonlinearQuery  # biases: the plain path
    for key, value in [("in_norm", "layernorm"), ("in_norm", "none"),
                       ("out_norm", "rmsnorm"), ("act", "relu")]:
        assert type(fast(query_args={key: value})) is NonlinearQuery, key
    assert not fast().fused_cpu(x.double())  # dtype mismatch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fast().fused_cpu(x)


def test_fused_nonlinear_query_frozen_parameters_get_no_gradient():
    """needs_input_grad is honoured: a frozen W1 and gain get None, the rest still match."""
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layer=1, n_head=4, d_model=32,
                      mlp_hidden=64, query="nonlinear")
    torch.manual_seed(0)
    plain = NonlinearQuery(cfg).double()
    plain.w1.weight.requires_grad_(False)
    plain.in_norm.weight.requires_grad_(False)
    q = apply_fast_paths(copy.deepcopy(plain))
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    q(x).sum().backward()
    assert q.w1.weight.grad is None and q.in_norm.weight.grad is None
    got = (x.grad.clone(), q.w2.weight.grad.clone(), q.out_norm.weight.grad.clone())
    x.grad = None
    plain(x).sum().backward()
    for a, b in zip(got, (x.grad, plain.w2.weight.grad, plain.out_norm.weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
