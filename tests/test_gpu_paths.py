"""The GPU fast paths (nlq/model/fast.py, nlq/run/batches.py, compile), each compared with
the plain path it replaces, on CPU: the paths are device-gated, and the tests open the gate
for CPU (FusedQKVAttention.fused_on, FastNonlinearQuery.compiled_on, Ahead(threaded=True)).
The same comparisons on CUDA are in tests/test_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config

from nlq.errors import NlqError
from nlq.model import ModelConfig, Transformer
from nlq.model.fast import (
    FastNonlinearQuery,
    FusedQKVAttention,
    apply_fast_paths,
    nonlinear_query,
)
from nlq.model.query import make_query
from nlq.run.batches import Ahead
from nlq.train.loop import compile_model


def model_cfg(**kw) -> ModelConfig:
    base = {"vocab_size": 61, "block_size": 16, "n_layer": 2, "n_head": 4, "d_model": 32,
            "mlp_hidden": 64}
    return ModelConfig(**{**base, **kw})


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """model with every parameter moved off its init (gains off 1, biases off 0), in fp64."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def loss_and_grads(model, idx):
    _, loss = model(idx, idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(a, b, tol):
    torch.testing.assert_close(a[0], b[0], **tol)
    for n, g in b[1].items():
        torch.testing.assert_close(a[1][n], g, **tol, msg=n)


@pytest.mark.parametrize("query,kw", [
    ("linear", {}),  # q, k, v in one product
    ("linear", {"bias": True, "n_kv_head": 2}),  # with biases, grouped keys and values
    ("linear", {"query_args": {"out_norm": "layernorm"}}),  # q normalised after the split
    ("nonlinear", {}),  # k, v in one product, the query apart
    ("identity", {"n_kv_head": 1}),
])
def test_fused_qkv_equals_three_projections(query, kw):
    """FusedQKVAttention (opened for CPU) vs the plain Attention, same weights: the loss and
    every parameter's gradient of a training step agree to fp64 rounding, and the parameter
    names are those of the plain model."""
    plain = perturbed(Transformer(model_cfg(query=query, **kw), seed=1))
    fused = copy.deepcopy(plain)
    for mod in fused.modules():
        if type(mod).__name__ == "Attention":
            mod.__class__ = FusedQKVAttention
            mod.fused_on = ("cpu",)
    assert sum(isinstance(m, FusedQKVAttention) for m in fused.modules()) == 2
    assert list(fused.state_dict()) == list(plain.state_dict())
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(2))
    assert_same_step(loss_and_grads(fused, idx), loss_and_grads(plain, idx),
                     {"rtol": 1e-10, "atol": 1e-12})


def test_fused_qkv_stays_apart_on_cpu_by_default():
    """Without the gate opened, the CPU path is the plain one: bitwise the same loss (the
    golden losses were computed so)."""
    plain = Transformer(model_cfg(), seed=1)
    fast = apply_fast_paths(copy.deepcopy(plain))
    assert any(isinstance(m, FusedQKVAttention) for m in fast.modules())
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(fast(idx, idx)[1], plain(idx, idx)[1])


@pytest.mark.parametrize("half", ["fold", "explicit"])
def test_nonlinear_query_function_equals_module(half):
    """fast.nonlinear_query (what CUDA compiles) is NonlinearQuery.forward's math: output and
    the gradients of the input and every weight agree to fp64 rounding."""
    cfg = model_cfg(query="nonlinear", query_args={"half": half})
    q = perturbed(make_query(cfg))
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    want = q(x)
    up = torch.randn_like(want)
    g_want = torch.autograd.grad((want * up).sum(), [x, *q.parameters()])
    got = nonlinear_query(x, q.in_norm.weight, q.w1.weight, q.w2.weight, q.out_norm.weight,
                          q.out_norm.bias, q.in_norm.eps, q.out_norm.eps, q.act.approximate,
                          q.explicit_half)
    g_got = torch.autograd.grad((got * up).sum(), [x, *q.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_apply_fast_paths_compiles_the_query_on_cuda_only_when_asked():
    m = Transformer(model_cfg(query="nonlinear"), seed=0)
    on = apply_fast_paths(copy.deepcopy(m))
    off = apply_fast_paths(copy.deepcopy(m), compile_query=False)
    assert {q.compiled_on for q in on.modules() if isinstance(q, FastNonlinearQuery)} == {
        ("cuda",)}
    assert {q.compiled_on for q in off.modules() if isinstance(q, FastNonlinearQuery)} == {()}


@pytest.mark.slow
def test_compiled_nonlinear_query_equals_plain_on_cpu():
    """The compiled query (torch.compile of fast.nonlinear_query, opened for CPU, fp32) in a
    whole training step vs the plain model: loss and gradients agree to fp32 rounding."""
    plain = Transformer(model_cfg(query="nonlinear"), seed=1)
    fast = copy.deepcopy(plain)
    for mod in fast.modules():
        if type(mod).__name__ == "NonlinearQuery":
            mod.__class__ = FastNonlinearQuery
            mod.compiled_on = ("cpu",)
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(2))
    assert_same_step(loss_and_grads(fast, idx), loss_and_grads(plain, idx),
                     {"rtol": 1e-4, "atol": 1e-6})


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_plain_loss_equals_chunked_loss(arch):
    """model.chunked_loss False (the GPU default: logits + F.cross_entropy) vs True (the CPU
    default, nlq/model/loss.py): the same loss and gradients, some targets ignored."""
    chunked = perturbed(Transformer(model_cfg(arch=arch), seed=1))
    plain = copy.deepcopy(chunked)
    chunked.chunked_loss, plain.chunked_loss = True, False
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(2))
    y = idx.clone()
    y[:, ::3] = -1
    logits_c, loss_c = chunked(idx, y)
    logits_p, loss_p = plain(idx, y)
    assert logits_c is None and logits_p is not None  # the chunked path forms no logits
    loss_c.backward()
    loss_p.backward()
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-12, atol=1e-12)
    for (n, a), b in zip(chunked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_prefetch_in_a_thread_gives_the_same_batches_in_any_order():
    """Ahead with its thread (as on CUDA): every get returns what build gives for that key,
    in order (the next item built ahead) and out of order (built on the spot)."""
    calls = []

    def build(i):
        calls.append(i)
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 100, (2, 3), generator=g), torch.full((2,), i)

    ahead = Ahead(build, torch.device("cpu"), threaded=True)
    for key, nxt in [(0, 1), (1, 2), (2, 3), (7, 8), (8, 9), (3, 4)]:
        got = ahead.get((key,), (nxt,))
        want = build(key)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert {1, 2, 3, 8, 9} <= set(calls)  # built ahead in the thread


def test_batches_with_prefetch_equal_batches_without(tmp_path):
    """A run's Batches with the thread (as on CUDA) give bitwise the batches of the plain
    path, micro-step by micro-step over several optimizer steps (grad_accum 2)."""
    from helpers import make_data

    from nlq.run.batches import Batches
    from nlq.run.world import World

    make_data(tmp_path / "d")
    cfg = tiny_config(tmp_path / "d", **{"train.grad_accum": 2})
    plain = Batches(cfg, World(), torch.device("cpu"))
    ahead = Batches(cfg, World(), torch.device("cpu"))
    ahead.ahead = Ahead(ahead.train_cpu, torch.device("cpu"), threaded=True)
    for step in range(4):
        for micro in plain.micros:
            a, b = plain.train(step, micro), ahead.train(step, micro)
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_compile_mode_is_checked():
    with pytest.raises(NlqError, match="train.compile_mode"):
        tiny_config("d", **{"train.compile": True, "train.compile_mode": "fastest"})
    with pytest.raises(NlqError, match="needs train.compile = true"):
        tiny_config("d", **{"train.compile_mode": "max-autotune-no-cudagraphs"})
    with pytest.raises(NlqError, match="train.compile_mode"):  # CUDA graphs: not offered
        tiny_config("d", **{"train.compile": True, "train.compile_mode": "reduce-overhead"})


@pytest.mark.parametrize("mode,parallel,world,scope", [
    ("default", "ddp", "1", "model"), ("max-autotune-no-cudagraphs", "ddp", "2", "model"),
    ("default", "fsdp", "1", "model"), ("max-autotune-no-cudagraphs", "fsdp", "2", "blocks"),
])
def test_compile_model_scope_and_mode(monkeypatch, mode, parallel, world, scope):
    """train.compile compiles the whole model with its loss, block by block only under a
    multi-process FSDP, with train.compile_mode as torch.compile's mode."""
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: seen.append((type(self).__name__, kw)))
    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = tiny_config("d", **{"train.compile": True, "train.compile_mode": mode,
                              "train.parallel": parallel})
    model = Transformer(model_cfg(), seed=0)
    compile_model(model, cfg.train)
    want_mode = None if mode == "default" else mode
    if scope == "model":
        assert seen == [("Transformer", {"mode": want_mode})]
    else:
        assert seen == [("Block", {"mode": want_mode})] * 2


def test_gelu_is_the_erf_form():
    """The compiled query keeps GELU's exact (erf) form, the paper's: approximate 'none'."""
    q = make_query(model_cfg(query="nonlinear"))
    x = torch.linspace(-3, 3, 7)
    assert q.act.approximate == "none"
    torch.testing.assert_close(F.gelu(x, approximate=q.act.approximate), F.gelu(x))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_plain_loss_under_autocast_is_the_fp32_loss_of_the_bf16_logits(reduction):
    """Under bf16 autocast the plain path hands the bf16 logits to cross-entropy (autocast
    runs it in fp32): the same loss, in fp32, as widening the logits first."""
    m = Transformer(model_cfg(), seed=1)
    m.chunked_loss = False
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(2))
    y = idx.clone()
    y[:, ::4] = -1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = m(idx, y, reduction=reduction)
        assert logits.dtype == torch.bfloat16
        want = F.cross_entropy(logits.float().view(-1, 61), y.view(-1), ignore_index=-1,
                               reduction="sum" if reduction == "mean" else "none")
    if reduction == "mean":
        want = want / (y != -1).sum()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want.view_as(loss), rtol=1e-6, atol=1e-7)
