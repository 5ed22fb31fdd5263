"""Where the nonlinear query's extra time goes: one layer's query, forward + backward, alone.

For each shape, nlq's own query modules are built from the config train_bench.py uses (same
d_model and rank; rows N = micro_batch x block_size) and timed in turn, one call of each per
round, `--iters` rounds, the median per variant:
    linear              Q = X W_Q (one (N, C) x (C, C) GEMM forward, two backward)
    nonlinear           the paper's f (docs/paper.md, "The nonlinear query") as nlq runs it,
                        on CPU its hand-written fused autograd kernel (nlq/model/kernels.py)
    nonlinear+modules   the same f without apply_fast_paths: plain nn modules (RMSNorm,
                        Linear, GELU, Linear, LayerNorm)
A call is forward + backward of a fixed upstream gradient, with fresh parameter and input
gradients. Between calls a 64 MiB buffer is written (`--warm` skips it): in a training step
every tensor a layer's query touches was evicted by the rest of the model since it was last
used, so the cold figures are the ones that add up to the step-level difference
(train_bench.py). `--profile` adds torch.profiler's per-op self time of each variant, the
real modules under the profiler (whose per-call overhead inflates short ops).

Usage: python benchmarks/query_bench.py [--shapes tiny,gpt3-small] [--iters 300] [--warm]
       [--profile] [--allow-dirty] [--results-dir DIR]
Writes benchmarks/results/query_bench-<date>-<commit>.json (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# this checkout's nlq (not an installed one), and record.py, train_bench.py beside this file
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import record
import train_bench  # its SHAPES

VARIANTS = ["linear", "nonlinear", "nonlinear+modules"]


def build(shape: str, variant: str):
    """(rows N, width C, a function running one forward + backward with fresh gradients)."""
    import torch

    from nlq.config import load_config
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
    if not variant.endswith("+modules"):  # the CPU kernels, as training applies them
        from nlq.model.fast import apply_fast_paths

        apply_fast_paths(q)
    x = torch.randn(N, C).requires_grad_()  # (N, C): the block's normalised input, flattened
    dq = torch.randn(N, C)
    leaves = [x, *q.parameters()]

    def call():
        for t in leaves:
            t.grad = None
        q(x).backward(dq)

    return N, C, call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="tiny,gpt3-small")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warm", action="store_true", help="no cache eviction between calls")
    ap.add_argument("--profile", action="store_true", help="also print per-op self times")
    record.add_arguments(ap)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    for sh in shapes:
        if sh not in train_bench.SHAPES or sh == "gpt3-small-gpu":
            raise SystemExit(f"query_bench: unknown shape {sh!r} (tiny, preset, gpt3-small)")
    if args.iters < 5:
        raise SystemExit("query_bench: --iters must be >= 5")
    rec = record.Recorder("query_bench", args)  # refuses a dirty tree before measuring

    import torch

    from nlq.train import alloc

    alloc.keep_freed_memory()  # as `nlq train` does on CPU
    junk = torch.empty(16 << 20)  # 64 MiB, larger than this CPU's caches

    def evict():
        if not args.warm:
            junk.zero_()

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
    rec.write({"mode": "query fwd+bwd per layer", "iters": args.iters,
               "caches": "warm" if args.warm else "cold",
               "intra_op_threads": torch.get_num_threads(),
               "loadavg_1min": os.getloadavg()[0], "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
