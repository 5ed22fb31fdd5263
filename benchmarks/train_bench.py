"""Training speed of every query variant, side by side in one run.

For each shape and each variant, one optimizer step = forward + backward + AdamW on a fixed
batch, fp32 on CPU (bf16 autocast on CUDA). Every measurement runs in its own subprocess
(clean memory peak, no cross-talk), variants interleaved repeat by repeat so machine noise
hits all of them alike; ratios are taken within a repeat. Also timed in each subprocess: a
1024^3 matmul (the peak MFU is relative to), and the data loader's time per step (nlq's
batch schedule).

    MFU = flops_per_token(cfg) * tokens/s / matmul peak, flops_per_token = 6N + 12 L d T
    (nlq/model/params.py).

Shapes: "tiny" is the tiny anchor shape of RESULTS.md (4 layers, d=256, 8 heads, V=8192, B=8,
T=256: the attention sees 2048 rows of 256); "preset" is nlq's own tiny preset, the model of
the README's main command (4 layers, d=128, T=128, B=8); "gpt3-small" is the paper's GPT-3
small (docs/paper.md, "The training recipe") at a CPU-sized batch (B=1, T=256). Not in the
default list: "gpt3-small-gpu", GPT-3 small at the paper's micro-batch (12 x 1024), for a GPU
(on CUDA the step runs under bf16 autocast and MFU is against a bf16 8192^3 matmul; use
+compile for torch.compile, AdamW is fused and SDPA picks its flash kernel).

Variants: a query (linear, nonlinear, identity, residual); "reference", a plain
nanoGPT-style model written below from the design (fused QKV, logits + F.cross_entropy), to
check nlq's linear arm is never slower; "official-linear" and "official-nonlinear", the
paper's official code's model (github.com/MarkoKarbevski/beyond_query_linearity, model.py,
query_mode "original" and "residual_gelu"; NLQ_OFFICIAL_MODEL=path of that file) at the same
shapes, with the same fused AdamW. The reference and official variants take +compile only.
Modifiers after "+" change how a variant runs:
  +logits     the loss from materialised (N, V) logits + F.cross_entropy (nlq's path before
              its CPU fast paths) instead of nlq/model/loss.py's chunked loss (on CPU; on a
              GPU that is the default already);
  +chunked    the chunked loss on a GPU too (model.chunked_loss = True);
  +glibc      glibc's default malloc thresholds instead of nlq/train/alloc.py's;
  +compile    train.compile = true (torch.compile of the model with its loss, as one graph);
  +blocks     with +compile: every block compiled on its own instead (nlq's compile before);
  +cudagraphs torch.compile(mode="reduce-overhead") (CUDA graphs; not a train.compile_mode:
              it failed in nlq's training loop, RESULTS.md, the GPU section);
  +modules    the model without nlq.model.apply_fast_paths: the CPU kernels, the fused QKV
              projection and the compiled query off, each module on its plain path;
  +ddp        under DDP in one process (the run is started with torchrun --nproc_per_node 1
              and the model wrapped in DistributedDataParallel even so): the wrapper's cost.
The step loads its batch as nlq/run/batches.py does (on a GPU built ahead in a thread into
pinned memory); "loader" is the share of the step spent waiting for it. NLQ_BENCH_PROFILE=1
also records each measurement's top GPU kernels by device time (torch.profiler, 3 steps).
Every variant runs as `nlq train` would (the allocator tuning applies to the reference too,
so that comparison is about the model code); "linear+logits+glibc" is nlq's linear arm as it
ran before its CPU fast paths (RESULTS.md, "train_bench after the CPU fast paths").

Usage: python benchmarks/train_bench.py [--shapes tiny,preset,gpt3-small] [--variants ...]
       [--repeats 5] [--steps N] [--allow-dirty] [--results-dir DIR]
       python benchmarks/train_bench.py --pairs 40 --variants linear,nonlinear [--shapes ...]
       [--block K]
--pairs: every variant in one process per shape, one step of each in turn; the ratios of
adjacent steps cancel machine-speed drift that separate processes cannot (on this shared
2-core machine the matmul peak moves by +-10% between processes).
Writes benchmarks/results/train_bench-<date>-<commit>.json (benchmarks/record.py: hardware,
torch, date, commit, command; results.mode says which of the two ran).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# this checkout's nlq (not an installed one), and record.py beside this file
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import record

SHAPES = {
    # the tiny anchor shape: 4 layers, d=256, 8 heads, vocab 8192, B=8, T=256
    "tiny": ("tiny", {"model.n_layer": 4, "model.d_model": 256, "model.n_head": 8,
                      "model.vocab_size": 8192, "model.block_size": 256,
                      "model.mlp_hidden": 1024, "train.micro_batch": 8}),
    # nlq's tiny preset as the README's main command trains it (one micro-batch of 8 x 128)
    "preset": ("tiny", {}),
    # GPT-3 small shapes (docs/paper.md, "The training recipe") at a CPU-sized batch
    "gpt3-small": ("gpt3-small", {"train.micro_batch": 1, "model.block_size": 256}),
    # GPT-3 small as the paper trains it, one micro-batch of 12 x 1024 (for a GPU)
    "gpt3-small-gpu": ("gpt3-small", {}),
    # the study's first GPU rung (nlq/experiments/ladder.toml R1): d=256, 4 layers, 8 x 256
    "r1-gpu": ("small", {"model.d_model": 256, "model.n_head": 4, "model.mlp_hidden": 1024,
                         "model.block_size": 256, "train.micro_batch": 8}),
}
STEPS = {"tiny": 10, "preset": 30, "gpt3-small": 5, "gpt3-small-gpu": 20, "r1-gpu": 100}
CPU_SHAPES = "tiny,preset,gpt3-small"
VARIANTS = ["linear", "nonlinear", "identity", "residual", "reference", "linear+logits+glibc"]
MODIFIERS = {"logits", "glibc", "compile", "modules", "chunked", "blocks", "cudagraphs", "ddp"}


BASES = ("linear", "nonlinear", "identity", "residual", "reference", "official-linear",
         "official-nonlinear")


def parse_variant(v: str) -> tuple[str, set[str]]:
    base, *mods = v.split("+")
    bad = [x for x in mods if x not in MODIFIERS]
    if base not in BASES or bad:
        raise SystemExit(f"train_bench: unknown variant {v!r} (one of {', '.join(BASES)}, "
                         f"then +{'/+'.join(sorted(MODIFIERS))})")
    if not base.startswith(("linear", "nonlinear", "identity", "residual")) and (
            set(mods) - {"compile"}):
        raise SystemExit(f"train_bench: {base} takes +compile only ({v!r})")
    if base.startswith("official") and not os.environ.get("NLQ_OFFICIAL_MODEL"):
        raise SystemExit("train_bench: the official variants need NLQ_OFFICIAL_MODEL=path of "
                         "the official code's model.py (github.com/MarkoKarbevski/"
                         "beyond_query_linearity)")
    return base, set(mods)


def official_model(path: str, m, query: str):
    """The paper's official model (its model.py, a nanoGPT fork) at nlq's shapes: "original"
    is its linear arm, "residual_gelu" its nonlinear query."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("official_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hs = m.d_model // m.n_head
    cfg = mod.GPTConfig(block_size=m.block_size, vocab_size=m.vocab_size, n_layer=m.n_layer,
                        num_heads=m.n_head, n_embd=m.d_model, head_size=hs, bias=False,
                        dropout=0.0, mlp_hidden_size=m.mlp_width, scale=hs ** -0.5,
                        query_mode="original" if query == "linear" else "residual_gelu")
    return mod.GPT(cfg)


def build(shape: str, variant: str):
    """(model config, device, step function) of one variant; step(i) runs training step i
    and returns the seconds it waited for its batch (nlq's loader, nlq/run/batches.py)."""
    import contextlib

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    from nlq.config import load_config
    from nlq.data.schedule import train_batch
    from nlq.model import Transformer, apply_fast_paths
    from nlq.run.batches import Ahead
    from nlq.train import dist
    from nlq.train.loop import compile_model, make_optimizer

    base, mods = parse_variant(variant)
    preset, over = SHAPES[shape]
    query = base.removeprefix("official-") if base.startswith(("reference", "official")) \
        else base
    query = "linear" if query == "reference" else query
    cfg = load_config(preset, {**over, "model.query": query, "train.fused_adamw": True,
                               "train.compile": "compile" in mods or "cudagraphs" in mods})
    m, t = cfg.model, cfg.train
    dev = dist.resolve_device("auto", int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)

    class Ref(nn.Module):  # nanoGPT-style: fused c_attn, pre-LN, tied head, no biases
        def __init__(self):
            super().__init__()
            C = m.d_model
            self.wte, self.wpe = nn.Embedding(m.vocab_size, C), nn.Embedding(m.block_size, C)
            self.blocks = nn.ModuleList(nn.ModuleDict({
                "ln1": nn.LayerNorm(C, bias=False), "attn": nn.Linear(C, 3 * C, bias=False),
                "proj": nn.Linear(C, C, bias=False), "ln2": nn.LayerNorm(C, bias=False),
                "fc": nn.Linear(C, m.mlp_width, bias=False),
                "out": nn.Linear(m.mlp_width, C, bias=False)}) for _ in range(m.n_layer))
            self.ln_f = nn.LayerNorm(C, bias=False)
            # GPT-2 / nanoGPT init: N(0, 0.02), residual projections / sqrt(2 L). With torch's
            # defaults (N(0, 1) embeddings, tied to the head) the logits start huge, softmax
            # underflows to subnormal floats and on Intel CPUs every op touching them slows
            # down (2-5x whole steps here); that would time the init, not the code.
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    resid = name.endswith(("proj.weight", "out.weight"))
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * m.n_layer) if resid else 0.02)

        def forward(self, idx, targets):
            B, T = idx.shape
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for b in self.blocks:
                q, k, v = b.attn(b.ln1(x)).split(m.d_model, dim=2)
                q, k, v = (z.view(B, T, m.n_head, -1).transpose(1, 2) for z in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
                x = x + b.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)
                x = x + b.out(F.gelu(b.fc(b.ln2(x))))
            logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V)
            return logits, F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1))

    if base == "reference":
        model = Ref()
    elif base.startswith("official"):
        model = official_model(os.environ["NLQ_OFFICIAL_MODEL"], m, query)
    else:
        model = Transformer(m)
        if "modules" not in mods:  # as nlq/train/loop.py does
            apply_fast_paths(model, compile_query=not t.compile)
        if "chunked" in mods:
            model.chunked_loss = True
    model = model.to(dev)
    if t.compile:
        if "cudagraphs" in mods:
            model.compile(mode="reduce-overhead")
        elif "blocks" in mods:  # nlq's compile before: block by block
            for block in model.blocks:
                block.compile()
        elif isinstance(model, Transformer):
            compile_model(model, t)  # as nlq/train/loop.py does
        else:
            model.compile()
    wrapped = model
    if "ddp" in mods:  # DDP even in one process: what the wrapper costs per GPU
        import torch.distributed as tdist

        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        wrapped = dist.ddp(model, dev)  # as nlq/train/dist.py wraps it
    opt = (make_optimizer(model, t, dev) if isinstance(model, Transformer) else
           torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), fused=True))
    kw = {"return_logits": True} if "logits" in mods else {}
    B, T = t.micro_batch, m.block_size
    data = np.random.default_rng(0).integers(0, m.vocab_size, 2_000_000).astype(np.uint16)

    def windows(i):  # nlq's batch schedule on random tokens: inputs, targets (B, T) each
        w = train_batch(data, 1, i, 0, B, 1, T)  # (B, T+1)
        return w[:, :-1], w[:, 1:].clone()

    loader = Ahead(windows, dev)  # as nlq/run/batches.py runs it
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
           else contextlib.nullcontext())

    def step(i):
        t0 = time.perf_counter()
        x, y = loader.get((i,), (i + 1,))
        t_load = time.perf_counter() - t0
        if "cudagraphs" in mods:
            torch.compiler.cudagraph_mark_step_begin()
        with amp:
            _, loss = wrapped(x, y, **kw)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t_load

    for i in range(3 if t.compile else 2):  # warm-up: allocator, kernels, AdamW state, compile
        step(i)
    return cfg, dev, step


def top_kernels(step, dev, first: int, n_steps: int = 3, top: int = 15) -> list:
    """The GPU kernels of n_steps steps by self device time: [name, ms per step, share]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + n_steps):
            step(i)
        torch.cuda.synchronize(dev)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key, us))
    total = sum(us for _, us in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return [[k[:90], us / 1e3 / n_steps, us / total] for k, us in rows[:top]]


def measure(shape: str, variant: str, steps: int) -> dict:
    """One subprocess' measurement (run with --child)."""
    import torch

    from nlq.model.params import flops_per_token
    from nlq.train import alloc

    if "glibc" not in parse_variant(variant)[1]:
        alloc.keep_freed_memory()  # as `nlq train` does on CPU
    cfg, dev, step = build(shape, variant)
    m, t = cfg.model, cfg.train
    B, T = t.micro_batch, m.block_size
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    load = sum(step(i) for i in range(2, 2 + steps))
    sync()
    dt = (time.perf_counter() - t0) / steps

    # the peak of the precision the step runs in: fp32 1024^3 on CPU, bf16 8192^3 on GPU
    n = 8192 if dev.type == "cuda" else 1024
    mm_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=mm_dtype)
    b = torch.randn(n, n, device=dev, dtype=mm_dtype)
    for _ in range(3):
        a @ b
    sync()
    t1, n_mm = time.perf_counter(), 20
    for _ in range(n_mm):
        a @ b
    sync()
    peak = 2 * n ** 3 * n_mm / (time.perf_counter() - t1)
    tok_s = B * T / dt
    mem = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
           else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    row = {"shape": shape, "variant": variant, "tok_per_s": tok_s, "ms_per_step": 1e3 * dt,
           "mfu": flops_per_token(m) * tok_s / peak, "matmul_gflops": peak / 1e9,
           "loader_frac": load / steps / dt, "peak_mem_mb": mem / 2 ** 20,
           "threads": torch.get_num_threads(), "device": str(dev)}
    if os.environ.get("NLQ_BENCH_PROFILE") == "1" and dev.type == "cuda":
        row["top_kernels"] = top_kernels(step, dev, 2 + steps)
    return row


def paired(shape: str, variants: list[str], pairs: int, block: int = 1) -> dict:
    """All variants in one process, `block` steps of each in turn, `pairs` rounds: machine-speed
    drift slower than a round hits every variant alike, so the per-round ratios are tighter
    than those of separate processes (run with --child-paired). With block > 1 the first step
    of each block is untimed: it brings the variant's weights and optimizer state back into
    the caches the other variants evicted, so the timed steps run warm, as in training."""
    import torch

    from nlq.train import alloc

    alloc.keep_freed_memory()
    steps = {v: build(shape, v)[2] for v in variants}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = {v: [] for v in variants}
    timed = max(1, block - 1)  # steps timed per block
    for r in range(pairs):
        order = variants if r % 2 == 0 else variants[::-1]  # neither always goes first
        for v in order:
            if block > 1:
                steps[v](2 + r * block)  # untimed: re-warm the caches for this variant
            sync()
            t0 = time.perf_counter()
            for i in range(timed):
                steps[v](3 + r * block + i)
            sync()
            times[v].append((time.perf_counter() - t0) / timed)
    return {"shape": shape, "pairs": pairs, "block": block, "threads": torch.get_num_threads(),
            "ms_per_step": {v: [1e3 * x for x in ts] for v, ts in times.items()}}


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median (the sign test's): the order
    statistics x_(k), x_(n-k+1) with k the largest rank whose binomial(n, 1/2) tail
    P(B < k) stays within (1 - level) / 2. Assumes independent rounds, which adjacent
    steps on a drifting machine only approximate."""
    xs, n = sorted(xs), len(xs)
    k, tail = 0, 0.0
    while k < n // 2:
        nxt = tail + math.comb(n, k) / 2 ** n  # P(B <= k)
        if nxt > (1 - level) / 2:
            break
        k, tail = k + 1, nxt
    if k == 0:  # too few rounds for this level
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]


def report_paired(args, shapes, variants) -> int:
    what = ("one step" if args.block == 1 else
            f"{args.block} steps (the first untimed)")
    print(f"paired, in one process per shape: {args.pairs} rounds of {what} per variant; "
          f"ratio = linear's step time over the variant's in the same round")
    print(f"{'shape':>10} {'variant':>20} {'ms/step':>8} {'ratio':>6} {'95% CI':>13} "
          f"{'IQR':>13} {'range':>13}")
    out = []
    for shape in shapes:
        cmd = [sys.executable, __file__, "--child-paired", shape, ",".join(variants),
               str(args.pairs), str(args.block)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            sys.stderr.write(res.stderr)
            raise SystemExit(f"train_bench: paired {shape} failed (exit {res.returncode})")
        row = json.loads(res.stdout.strip().splitlines()[-1])
        lin = row["ms_per_step"]["linear"]
        row["summary"] = {}
        for v in variants:
            r = sorted(a / b for a, b in zip(lin, row["ms_per_step"][v]))
            q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
            ci = median_ci(r)
            row["summary"][v] = {"ms_per_step": statistics.median(row["ms_per_step"][v]),
                                 "ratio_vs_linear": statistics.median(r),
                                 "ratio_median_ci95": list(ci),
                                 "ratio_iqr": [q[0], q[2]], "ratio_range": [r[0], r[-1]]}
            sm = row["summary"][v]
            print(f"{shape:>10} {v:>20} {sm['ms_per_step']:8.1f} {sm['ratio_vs_linear']:6.3f} "
                  f"{ci[0]:6.3f}-{ci[1]:.3f} {q[0]:6.3f}-{q[2]:.3f} {r[0]:6.3f}-{r[-1]:.3f}",
                  flush=True)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default=CPU_SHAPES)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per measurement (default " +
                         ", ".join(f"{k} {v}" for k, v in STEPS.items()) + ")")
    ap.add_argument("--pairs", type=int, default=0,
                    help="instead: all variants in one process per shape, one step each in\n"
                         "turn for PAIRS rounds (ratios from adjacent steps; no +glibc)")
    ap.add_argument("--child", nargs=3, metavar=("SHAPE", "VARIANT", "STEPS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--block", type=int, default=1,
                    help="with --pairs: steps of a variant per round; the first of a block\n"
                         "is untimed (re-warms its caches), the rest are averaged")
    ap.add_argument("--child-paired", nargs=4, help=argparse.SUPPRESS)
    record.add_arguments(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    if args.child_paired:
        shape, vs, n, block = args.child_paired
        print(json.dumps(paired(shape, vs.split(","), int(n), int(block))))
        return 0
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    for sh in shapes:
        if sh not in SHAPES:
            raise SystemExit(f"train_bench: unknown shape {sh!r} (one of {', '.join(SHAPES)})")
    for v in variants:
        parse_variant(v)
    if "linear" not in variants:
        raise SystemExit("train_bench: --variants must include linear (ratios are against it)")
    if args.repeats < 1 or args.block < 1 or (args.steps is not None and args.steps < 1):
        raise SystemExit("train_bench: --repeats, --block and --steps must be >= 1")
    rec = record.Recorder("train_bench", args)  # refuses a dirty tree before measuring
    if args.pairs:
        if any({"glibc", "ddp"} & parse_variant(v)[1] for v in variants):
            raise SystemExit("train_bench: +glibc and +ddp are per process; they cannot be "
                             "paired in one")
        rows = report_paired(args, shapes, variants)
        rec.write({"mode": "paired", "pairs": args.pairs, "block": args.block,
                   **run_state(), "paired": rows})
        return 0
    rows, failed, stopped = [], [], None

    def stop(signum, frame):  # a time limit's SIGTERM: keep what was measured
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        for r in range(args.repeats):
            for shape in shapes:
                steps = args.steps or STEPS[shape]
                for v in variants:
                    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "1"] if "ddp" in parse_variant(v)[1]
                              else [sys.executable])
                    # subprocess.run kills the child when the signal interrupts the wait
                    out = subprocess.run([*launch, __file__, "--child", shape, v, str(steps)],
                                         capture_output=True, text=True, check=False)
                    if out.returncode != 0:  # one variant's failure is its row, not the run's
                        sys.stderr.write(out.stderr[-4000:])
                        print(f"repeat {r} {shape:>10} {v:>20}: FAILED (exit "
                              f"{out.returncode})", flush=True)
                        failed.append({"shape": shape, "variant": v, "repeat": r,
                                       "exit": out.returncode})
                        continue
                    row = json.loads(out.stdout.strip().splitlines()[-1]) | {"repeat": r}
                    rows.append(row)
                    for name, ms, share in row.get("top_kernels", []):
                        print(f"    {share:6.1%} {ms:8.3f} ms/step  {name}")
                    print(f"repeat {r} {shape:>10} {v:>20}: {row['tok_per_s']:9,.0f} tok/s "
                          f"{row['ms_per_step']:8.1f} ms/step  MFU {row['mfu']:5.1%}  "
                          f"(matmul {row['matmul_gflops']:.0f} GFLOP/s)", flush=True)
    except Stopped as e:
        stopped = f"signal {e.args[0]} after {len(rows)} row(s)"
        print(f"train_bench: stopped by {stopped}: writing what was measured", flush=True)
    summary = {}
    print("\nmedian over repeats; ratio = tok/s over the linear arm's in the same repeat "
          "(median, and the lowest and highest repeat)")
    print(f"{'shape':>10} {'variant':>20} {'tok/s':>9} {'ms/step':>8} {'MFU':>6} {'ratio':>6} "
          f"{'range':>13} {'loader':>7} {'mem MB':>7}")
    for shape in shapes:
        lin = {x["repeat"]: x for x in rows if x["shape"] == shape and x["variant"] == "linear"}
        for v in variants:
            # rows with the linear arm of their repeat (a stopped or failed run lacks some)
            mine = [x for x in rows if x["shape"] == shape and x["variant"] == v
                    and x["repeat"] in lin]
            if not mine:
                continue
            ratios = [x["tok_per_s"] / lin[x["repeat"]]["tok_per_s"] for x in mine]
            s = {k: statistics.median(x[k] for x in mine)
                 for k in ("tok_per_s", "ms_per_step", "mfu", "loader_frac", "peak_mem_mb")}
            s["ratio_vs_linear"] = statistics.median(ratios)
            s["ratio_range"] = [min(ratios), max(ratios)]
            summary[f"{shape}/{v}"] = s
            print(f"{shape:>10} {v:>20} {s['tok_per_s']:9,.0f} {s['ms_per_step']:8.1f} "
                  f"{s['mfu']:6.1%} {s['ratio_vs_linear']:6.3f} "
                  f"{min(ratios):6.3f}-{max(ratios):.3f} {s['loader_frac']:7.2%} "
                  f"{s['peak_mem_mb']:7.0f}")
    rec.write({"mode": "separate processes", "repeats": args.repeats, **run_state(),
               "summary": summary, "rows": rows, "failed": failed, "stopped": stopped})
    return 1 if failed or stopped else 0


class Stopped(Exception):
    """A signal stopped the run (not InterruptedError: subprocess retries on that one)."""


def run_state() -> dict:
    """What the machine was doing: on a shared machine the load explains noisy figures."""
    import torch

    return {"intra_op_threads": torch.get_num_threads(), "loadavg_1min": os.getloadavg()[0]}


if __name__ == "__main__":
    raise SystemExit(main())
