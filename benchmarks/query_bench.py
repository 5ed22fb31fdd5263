"""Where the nonlinear query's extra time goes: one layer's query, forward + backward, alone.

For each shape, nlq's own query modules are built from the config train_bench.py uses (same
d_model and rank; rows N = micro_batch x block_size) and timed in turn, one call of each per
round, `--iters` rounds, the median per variant:
    linear              Q = X W_Q (one (N, C) x (C, C) GEMM forward, two backward)
    nonlinear           the paper's f as the fused CPU autograd node (_NonlinearQueryCPU)
    nonlinear+modules   the same f as plain nn modules (RMSNorm, Linear, GELU, Linear, LayerNorm)
A call is forward + backward of a fixed upstream gradient, with fresh parameter and input
gradients. Between calls a 64 MiB buffer is written (`--warm` skips it): in a training step
every tensor a layer's query touches was evicted by the rest of the model since it was last
used, so the cold figures are the ones that add up to the step-level difference
(train_bench.py). `--profile` adds torch.profiler's per-op self time of each variant.

`--ops` times the linear and fused nonlinear queries op by op instead, with a clock read
between ATen calls and no profiler (whose overhead inflated the short elementwise ops), the
caches evicted before the forward and again before the backward (in a step the rest of the
model runs in between). The op-by-op copies below must stay the node's exact sequence: each
run first checks that they reproduce the module's output and every gradient bitwise.

Usage: python benchmarks/query_bench.py [--shapes tiny,gpt3-small] [--iters 300] [--warm]
       [--profile | --ops] [--out benchmarks/results/query_bench.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_bench  # noqa: E402  (its SHAPES and its JSON writer)

VARIANTS = ["linear", "nonlinear", "nonlinear+modules"]


def build(shape: str, variant: str):
    """(rows N, width C, a function running one forward + backward with fresh gradients,
    (the query module, its input x, the upstream gradient dq) that function uses)."""
    import contextlib

    import torch

    from nlq.config import load_config
    from nlq.model import kernels
    from nlq.model.query import make_query

    preset, over = train_bench.SHAPES[shape]
    base = variant.split("+")[0]
    cfg = load_config(preset, {**over, "model.query": base})
    m, t = cfg.model, cfg.train
    N, C = t.micro_batch * m.block_size, m.d_model
    torch.manual_seed(0)
    q = make_query(m)
    for p in q.parameters():  # GPT-2-like scale (exact zeros and ones would be atypical)
        if p.dim() == 2:
            torch.nn.init.normal_(p, 0.0, 0.02)
    # +modules: every module takes its plain path, no CPU kernel (nlq/model/kernels.py)
    plain = kernels.disabled if variant.endswith("+modules") else contextlib.nullcontext
    x = torch.randn(N, C).requires_grad_()  # (N, C): the block's normalised input, flattened
    dq = torch.randn(N, C)
    leaves = [x, *q.parameters()]

    def call():
        for t in leaves:
            t.grad = None
        with plain():
            q(x).backward(dq)

    return N, C, call, (q, x, dq)


def op_sequence(variant: str, q, x, dq, tick):
    """The variant's forward then backward as single ATen calls, `tick(name, gemm)` after each
    and `tick(None)` between the passes (the caller evicts there). Returns (output,
    {name: grad}) for the bitwise check against autograd. For "nonlinear" this is
    _NonlinearQueryCPU's forward and backward (nlq/model/query.py) written out, every
    gradient computed."""
    import torch
    import torch.nn.functional as F

    from nlq.model.kernels import rstd as _rstd

    if variant == "linear":
        w = q.proj.weight
        y = torch.mm(x, w.t())  # (N, C)
        tick("fwd x W^T", True)
        tick(None)
        dx = torch.mm(dq, w)
        tick("bwd dx = dq W", True)
        dw = torch.mm(dq.t(), x)
        tick("bwd dW = dq^T x", True)
        return y, {"x": dx, "proj.weight": dw}
    C = x.shape[-1]
    g, w1, w2, ln_w = q.in_norm.weight, q.w1.weight, q.w2.weight, q.out_norm.weight
    rstd = _rstd(x, q.in_norm.eps)  # (N, 1)
    tick("fwd rstd of x")
    wg = w1 * g  # (r, C)
    tick("fwd W1 g (weights)")
    h = torch.mm(x, wg.t())  # (N, r)
    tick("fwd x (W1 g)^T", True)
    h.mul_(rstd)
    tick("fwd h *= rstd")
    a = F.gelu(h)
    tick("fwd GELU")
    z = torch.mm(a, w2.t())  # (N, C)
    tick("fwd a W2^T", True)
    y, mean, rstd_out = torch.native_layer_norm(z, (C,), ln_w, None, q.out_norm.eps)
    tick("fwd LayerNorm")
    y.add_(x)
    tick("fwd + x (identity)")
    tick(None)
    dz, d_lnw, _ = torch.ops.aten.native_layer_norm_backward(
        dq, z, (C,), mean, rstd_out, ln_w, None, [True, True, False])
    tick("bwd LayerNorm")
    dw2 = torch.mm(dz.t(), a)
    tick("bwd dW2 = dz^T a", True)
    da = torch.mm(dz, w2)  # (N, r)
    tick("bwd da = dz W2", True)
    du = torch.ops.aten.gelu_backward(da, h)
    tick("bwd GELU'")
    du.mul_(rstd)
    tick("bwd du *= rstd")
    s = torch.linalg.vecdot(du, h).unsqueeze_(-1)  # (N, 1)
    tick("bwd sum_j du_j h_j")
    dx = torch.addcmul(dq, x, s.mul_(rstd), value=-1.0 / C)
    tick("bwd dq - x rstd s / C")
    dx.addmm_(du, wg)
    tick("bwd dx += du (W1 g)", True)
    dwg = torch.mm(du.t(), x)  # (r, C)
    tick("bwd d(W1 g) = du^T x", True)
    dg = (dwg * w1).sum(0)
    tick("bwd dg (weights)")
    dw1 = dwg * g
    tick("bwd dW1 (weights)")
    return y, {"x": dx, "in_norm.weight": dg, "w1.weight": dw1, "w2.weight": dw2,
               "out_norm.weight": d_lnw}


def op_sequence_matches(variant: str, call, q, x, dq) -> bool:
    """Whether op_sequence gives the module's output and every gradient bitwise."""
    import torch

    with torch.no_grad():
        y, grads = op_sequence(variant, q, x, dq, lambda name, gemm=False: None)
        ref = q(x)
    call()
    want = {"x": x.grad, **{n: p.grad for n, p in q.named_parameters()}}
    return torch.equal(y, ref) and set(grads) == set(want) and all(
        torch.equal(grads[n], want[n]) for n in want)


def ops_table(shape: str, iters: int, evict, cold: bool) -> list[dict]:
    """Median ms of every op of the linear and the fused nonlinear query, and of the same
    forward and backward run through the module and autograd (see --ops); the two variants
    alternate round by round so machine drift hits both alike."""
    import torch

    variants = ("linear", "nonlinear")
    built = {}
    for v in variants:
        N, C, call, (q, x, dq) = build(shape, v)
        if not op_sequence_matches(v, call, q, x, dq):
            raise SystemExit(f"query_bench --ops: the {v} op sequence no longer matches "
                             "nlq/model/query.py; update op_sequence")
        built[v] = (q, x, dq)
    times: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    gemms: set[str] = set()
    clock, current = 0.0, variants[0]

    def tick(name, gemm=False):
        nonlocal clock
        t = time.perf_counter()
        if name is None:  # between forward and backward: cold again, clock restarts
            evict()
            t = time.perf_counter()
        else:
            times[current].setdefault(name, []).append(1e3 * (t - clock))
            if gemm:
                gemms.add(name)
        clock = t

    for i in range(iters + 3):
        if i == 3:  # after the warm-up
            for v in variants:
                times[v].clear()
        for v in variants:
            current = v
            q, x, dq = built[v]
            with torch.no_grad():
                evict()
                clock = time.perf_counter()
                op_sequence(v, q, x, dq, tick)
            for leaf in (x, *q.parameters()):  # the module under autograd, cold the same way
                leaf.grad = None
            evict()
            t0 = time.perf_counter()
            y = q(x)
            t1 = time.perf_counter()
            evict()
            t2 = time.perf_counter()
            y.backward(dq)
            t3 = time.perf_counter()
            times[v].setdefault("module forward", []).append(1e3 * (t1 - t0))
            times[v].setdefault("module backward", []).append(1e3 * (t3 - t2))
    rows = []
    for v in variants:
        total = {"GEMM": 0.0, "other": 0.0}
        print(f"  {shape} {v}: ms per op, median of {iters}, {'cold' if cold else 'warm'}")
        for name, ts in times[v].items():
            if name.startswith("module"):
                continue
            med = statistics.median(ts)
            kind = "GEMM" if name in gemms else "other"
            total[kind] += med
            rows.append({"shape": shape, "rows": N, "d_model": C, "variant": v,
                         "op": name, "kind": kind, "ms_median": med})
            print(f"    {name:28} {kind:6} {med:7.3f}")
        mod = sum(statistics.median(times[v][k]) for k in ("module forward", "module backward"))
        rows.append({"shape": shape, "rows": N, "d_model": C, "variant": v, "op": "module",
                     "kind": "fwd+bwd", "ms_median": mod, "ops_gemm_ms": total["GEMM"],
                     "ops_other_ms": total["other"]})
        print(f"    {'sum of op medians':28} GEMMs {total['GEMM']:.3f} + other "
              f"{total['other']:.3f} = {total['GEMM'] + total['other']:.3f}; through the "
              f"module and autograd {mod:.3f}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="tiny,gpt3-small")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warm", action="store_true", help="no cache eviction between calls")
    ap.add_argument("--profile", action="store_true", help="also print per-op self times")
    ap.add_argument("--ops", action="store_true",
                    help="op-by-op times of linear and nonlinear, no profiler (see above)")
    ap.add_argument("--out", default=None, help="JSON path (default results/query_bench.json, "
                    "results/query_bench_ops.json with --ops)")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    for sh in shapes:
        if sh not in train_bench.SHAPES or sh == "gpt3-small-gpu":
            raise SystemExit(f"query_bench: unknown shape {sh!r} (tiny, preset, gpt3-small)")
    if args.iters < 5:
        raise SystemExit("query_bench: --iters must be >= 5")
    if args.ops and args.profile:
        raise SystemExit("query_bench: --ops and --profile are two ways of timing ops; pick one")
    results = Path(__file__).parent / "results"
    name = "query_bench_ops.json" if args.ops else "query_bench.json"
    args.out = args.out or str(results / name)

    import torch

    from nlq.train import alloc

    alloc.keep_freed_memory()  # as `nlq train` does on CPU
    junk = torch.empty(16 << 20)  # 64 MiB, larger than this CPU's caches

    def evict():
        if not args.warm:
            junk.zero_()

    meta = {"iters": args.iters, "caches": "warm" if args.warm else "cold"}
    if args.ops:
        print(f"one layer's query op by op, {meta['caches']} caches, {args.iters} rounds, "
              f"{torch.get_num_threads()} threads")
        rows = [r for sh in shapes for r in ops_table(sh, args.iters, evict, not args.warm)]
        train_bench.write(argparse.Namespace(out=args.out),
                          {"mode": "query ops per layer", **meta}, {"rows": rows})
        return 0
    rows = []
    print(f"one layer's query, forward + backward, {'warm' if args.warm else 'cold'} caches, "
          f"{args.iters} rounds, {torch.get_num_threads()} threads; median ms per call")
    print(f"{'shape':>10} {'N x C':>10} {'variant':>18} {'ms':>7} {'IQR':>13} {'vs linear':>10}")
    for shape in shapes:
        built = {v: build(shape, v) for v in VARIANTS}
        N, C = built["linear"][:2]
        calls = {v: b[2] for v, b in built.items()}
        times = {v: [] for v in VARIANTS}
        for _ in range(3):  # warm-up: allocator, oneDNN primitives
            for call in calls.values():
                call()
        for _ in range(args.iters):
            for v, call in calls.items():
                evict()
                t0 = time.perf_counter()
                call()
                times[v].append(1e3 * (time.perf_counter() - t0))
        lin = statistics.median(times["linear"])
        for v in VARIANTS:
            med = statistics.median(times[v])
            q = statistics.quantiles(times[v], n=4)
            rows.append({"shape": shape, "rows": N, "d_model": C, "variant": v,
                         "ms_median": med, "ms_iqr": [q[0], q[2]], "extra_ms_vs_linear": med - lin})
            print(f"{shape:>10} {f'{N}x{C}':>10} {v:>18} {med:7.3f} {q[0]:6.3f}-{q[2]:.3f} "
                  f"{med - lin:+9.3f}", flush=True)
        if args.profile:
            from torch.profiler import profile

            n = 50
            for v, call in calls.items():
                with profile(record_shapes=True) as prof:
                    for _ in range(n):
                        evict()
                        call()
                ev = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                             if [junk.numel()] not in e.input_shapes),  # not the eviction
                            key=lambda e: -e.self_cpu_time_total)
                print(f"  {shape} {v}: self time per call, top ops (profiler overhead included)")
                for e in ev[:12]:
                    ins = ",".join("x".join(map(str, sh)) for sh in e.input_shapes if sh)
                    print(f"    {e.key[:36]:36} {ins[:30]:30} "
                          f"{e.self_cpu_time_total / n / 1e3:7.3f} ms x{e.count / n:.0f}")
    ns = argparse.Namespace(out=args.out)
    train_bench.write(ns, {"mode": "query fwd+bwd per layer", **meta}, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
