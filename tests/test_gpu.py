"""Real GPU checks, each comparing a CUDA computation with the CPU one it must reproduce: a
bf16-autocast training run against fp32 on CPU, the nonlinear query's plain path against the
CPU kernel, the chunked loss under bf16 autocast against F.cross_entropy on the logits, and
seeds trained as one stack under bf16 against their lone fp32 CPU runs.
Marked `gpu`: tests/conftest.py skips them where there is no CUDA.

Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per value), so a
gradient element may be off by ~1e-2 of its scale; a mean loss over thousands of tokens
averages the rounding out. The same comparisons on CPU under bf16 autocast (the only
hardware at hand when they were written) differ by 1e-5 (train loss), 8e-4 (grad norm) and
4e-6 (val loss) relative; the bounds below are ~6-500x that, for the GPU's other kernels.
fp32 GEMMs on CUDA differ from the CPU's in summation order only (TF32 is off by default for
matmuls): ~1e-6.
"""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import metrics, shared_data, tiny_config

from nlq.model import loss as chunked
from nlq.model.fast import apply_fast_paths
from nlq.model.query import make_query

pytestmark = pytest.mark.gpu

one_thread = helpers.one_thread  # autouse: the CPU side of each comparison on one thread


def trained(cfg, run_dir, device: str, precision: str) -> dict:
    """Per-step train losses and the final val loss of `nlq train` on device."""
    from nlq.train.loop import train

    cfg = cfg.replace(**{"train.device": device, "train.precision": precision})
    summary = train(cfg, run_dir, progress=False)
    return {"loss": [r["loss"] for r in metrics(run_dir, "train")],
            "grad_norm": [r["grad_norm"] for r in metrics(run_dir, "train")],
            "val_loss": summary["val_loss"]}


def test_bf16_training_on_cuda_matches_fp32_on_cpu(tmp_path_factory, tmp_path):
    """Two optimizer steps of the tiny test model through the training loop: on CUDA under
    bf16 autocast the losses, grad norms and final val loss are those of fp32 on CPU within
    bf16 rounding (step 1 compares one forward; step 2 also one AdamW update)."""
    cfg = tiny_config(shared_data(tmp_path_factory), **{"train.max_steps": 2,
                                                        "train.eval_interval": 2})
    cpu = trained(cfg, tmp_path / "cpu", "cpu", "fp32")
    gpu = trained(cfg, tmp_path / "cuda", "cuda", "bf16")
    assert len(gpu["loss"]) == len(cpu["loss"]) == 2
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=5e-3)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=2e-2)
    assert gpu["val_loss"] == pytest.approx(cpu["val_loss"], rel=5e-3)


def test_compiled_training_on_cuda_matches_fp32_on_cpu(tmp_path_factory, tmp_path):
    """The same two steps with train.compile (the whole model with its loss as one graph),
    nonlinear query: on CUDA under bf16 as fp32 on CPU."""
    cfg = tiny_config(shared_data(tmp_path_factory), **{
        "train.max_steps": 2, "train.eval_interval": 2, "model.query": "nonlinear"})
    cpu = trained(cfg, tmp_path / "cpu", "cpu", "fp32")
    gpu = trained(cfg.replace(**{"train.compile": True}),
                  tmp_path / "cuda", "cuda", "bf16")
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=5e-3)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=2e-2)
    assert gpu["val_loss"] == pytest.approx(cpu["val_loss"], rel=5e-3)


@pytest.mark.parametrize("query", ["linear", "nonlinear"])
def test_cuda_fast_paths_match_the_plain_model(query):
    """apply_fast_paths on CUDA (fused QKV projection; for nonlinear the compiled query too)
    vs the plain model on CUDA, fp32, same weights: loss and every gradient agree, and the
    fast paths did run."""
    import copy

    from nlq.model import Transformer
    from nlq.model.fast import FusedQKVAttention

    cfg = tiny_config("unused", **{"model.query": query}).model
    plain = Transformer(cfg, seed=1).cuda()
    fast = apply_fast_paths(copy.deepcopy(plain))
    assert any(isinstance(m, FusedQKVAttention) for m in fast.modules())
    idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), device="cuda")
    out = {}
    for name, model in (("fast", fast), ("plain", plain)):
        _, loss = model(idx, idx)
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out["fast"][0], out["plain"][0], rtol=1e-5, atol=1e-6)
    for n, g in out["plain"][1].items():
        torch.testing.assert_close(out["fast"][1][n], g, rtol=1e-3, atol=1e-6, msg=n)


def test_prefetched_batches_on_cuda_equal_the_cpu_batches(tmp_path_factory):
    """Batches on CUDA (built ahead in a thread, pinned, copied without blocking) are the
    CPU path's batches, over several steps of grad accumulation."""
    from nlq.run.batches import Batches
    from nlq.run.world import World

    cfg = tiny_config(shared_data(tmp_path_factory), **{"train.grad_accum": 2})
    cpu = Batches(cfg, World(), torch.device("cpu"))
    gpu = Batches(cfg, World(), torch.device("cuda"))
    assert gpu.ahead.pinned
    for step in range(3):
        for micro in cpu.micros:
            a, b = cpu.train(step, micro), gpu.train(step, micro)
            assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))


def test_nonlinear_query_plain_path_on_cuda_matches_the_cpu_kernel():
    """The nonlinear query in fp32: CUDA runs its plain modules, CPU the hand-written kernel;
    outputs and the gradients of the input and of every weight agree."""
    cfg = tiny_config("unused", **{"model.query": "nonlinear", "model.d_model": 64}).model
    torch.manual_seed(0)
    q_cpu = apply_fast_paths(make_query(cfg))  # the CPU kernel, as training runs it
    with torch.no_grad():  # norm gains and biases off their init, so their gradients matter
        for p in q_cpu.parameters():
            p.add_(0.1 * torch.randn_like(p))
    q_gpu = apply_fast_paths(make_query(cfg), compile_query=False).cuda()
    q_gpu.load_state_dict(q_cpu.state_dict())
    x = torch.randn(4, 16, cfg.d_model)  # (B, T, C)
    assert q_cpu.fused_cpu(x), "the CPU side must take the kernel"
    assert not q_gpu.fused_cpu(x.cuda())

    x_cpu, x_gpu = x.clone().requires_grad_(), x.cuda().requires_grad_()
    y_cpu, y_gpu = q_cpu(x_cpu), q_gpu(x_gpu)
    g = torch.randn_like(y_cpu)  # an arbitrary upstream gradient
    y_cpu.backward(g)
    y_gpu.backward(g.cuda())
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x_gpu.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-5)
    for (name, p_cpu), p_gpu in zip(q_cpu.named_parameters(), q_gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_chunked_loss_under_bf16_autocast_matches_cross_entropy(monkeypatch):
    """linear_cross_entropy in several chunks under bf16 autocast on CUDA: the loss and the
    gradients of the hidden states and of the weight are those of F.cross_entropy on the
    (bf16-autocast) logits, some targets ignored."""
    N, C, V = 1000, 64, 1000  # rows, d_model, vocab
    monkeypatch.setitem(chunked.CHUNK_ELEMENTS, "cuda", chunked.MIN_CHUNK_ROWS * V)  # 4 chunks
    assert chunked.chunk_rows(N, V, torch.device("cuda")) < N
    torch.manual_seed(0)
    h = torch.randn(N, C, device="cuda")  # (N, C)
    w = 0.1 * torch.randn(V, C, device="cuda")  # (V, C)
    y = torch.randint(0, V, (N,), device="cuda")  # (N,)
    y[::7] = -1  # ignored rows

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = chunked.linear_cross_entropy(h1, w1, y, reduction="mean", ignore_index=-1)
    got.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = h2 @ w2.t()  # (N, V), bf16
    want = F.cross_entropy(logits.float(), y, ignore_index=-1)
    want.backward()

    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    assert_close_to_scale(h1.grad, h2.grad, 1e-2)
    assert_close_to_scale(w1.grad, w2.grad, 1e-2)


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Every element within tol of want's largest magnitude (a mean loss's gradients are
    ~1/N each: an elementwise atol would pass anything)."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert scale > 0 and err <= tol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


def test_a_bf16_stack_on_cuda_matches_lone_fp32_runs_on_cpu(tmp_path_factory, tmp_path):
    """Two seeds of the nonlinear query trained as one stack (nlq/train/stack.py: vmap, the
    loss, attention and norms widened by hand, since autocast's fp32 policy does not reach
    ops under vmap) on CUDA under bf16: each member's losses, grad norms and val loss are its
    lone fp32 CPU run's within the bf16 bounds above."""
    from nlq.train.stack import train_stack

    cfgs = [tiny_config(shared_data(tmp_path_factory), **{
        "train.max_steps": 2, "train.eval_interval": 2, "model.query": "nonlinear",
        "train.seed": 3 + k, "data.seed": 7 + k}) for k in range(2)]
    dirs = [tmp_path / f"stack{k}" for k in range(2)]
    gpu = [c.replace(**{"train.device": "cuda", "train.precision": "bf16"}) for c in cfgs]
    summaries = train_stack(gpu, dirs, progress=False)
    for k, (c, d, s) in enumerate(zip(cfgs, dirs, summaries)):
        cpu = trained(c, tmp_path / f"cpu{k}", "cpu", "fp32")
        rows = metrics(d, "train")
        assert [r["loss"] for r in rows] == pytest.approx(cpu["loss"], rel=5e-3)
        assert [r["grad_norm"] for r in rows] == pytest.approx(cpu["grad_norm"], rel=2e-2)
        assert s["val_loss"] == pytest.approx(cpu["val_loss"], rel=5e-3)
        assert s["stack"] == 2
