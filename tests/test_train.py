"""`nlq train` in process: every TrainConfig key does what it says, the lr schedule follows its
formula, weight decay hits 2-D matrices only, the val loss falls on learnable data, and the
logged val loss is the sum of nats over the sum of tokens of the fixed val windows.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import helpers
import pytest
import torch
from helpers import ckpt_dirs, final_ckpt, load_ckpt, make_data, metrics, tiny_config
from safetensors.torch import load_file

from nlq.config import TrainConfig
from nlq.data.schedule import TokenData, val_windows
from nlq.errors import NlqError
from nlq.model import Transformer
from nlq.run import batches
from nlq.train.loop import make_optimizer, train

one_thread = helpers.one_thread  # autouse: tiny models run ~10x faster on one thread


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """run(**overrides) -> run dir, cached: every key's variant is compared with one base."""
    root, cache = tmp_path_factory.mktemp("runs"), {}

    def run(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            d = root / f"run{len(cache)}"
            train(tiny_config(data, **overrides), d, progress=False)
            cache[key] = d
        return cache[key]

    return run


# -- what each key changes ------------------------------------------------------------------


def expected_lr(s: int, lr: float, min_lr: float, warmup: int, max_steps: int) -> float:
    """The lr of optimizer step s (0-based), written out independently of the loop: linear
    warmup lr*(s+1)/(warmup+1), then cosine from lr to min_lr, reached at the last step."""
    if s < warmup:
        return lr * (s + 1) / (warmup + 1)
    ratio = (s - warmup) / (max_steps - 1 - warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - min_lr)


def train_rows(d):
    return metrics(d, "train")


def check_tokens(base, var, cb, cv):
    for d, c in ((base, cb), (var, cv)):
        rows = train_rows(d)
        per = c.train.micro_batch * c.train.grad_accum * c.model.block_size
        assert [r["tokens"] for r in rows] == [r["step"] * per for r in rows]
    assert train_rows(base)[0]["tokens"] != train_rows(var)[0]["tokens"]


def check_final_step(base, var, cb, cv):
    for d, c in ((base, cb), (var, cv)):
        assert train_rows(d)[-1]["step"] == c.train.max_steps
        assert final_ckpt(d).name == f"step_{c.train.max_steps:06d}"
    assert cb.train.max_steps != cv.train.max_steps


def check_lr(base, var, cb, cv):
    for d, c in ((base, cb), (var, cv)):
        t = c.train
        got = [r["lr"] for r in train_rows(d)]  # the row of step s+1 logs step s's lr
        want = [expected_lr(s, t.lr, t.min_lr, t.warmup_steps, t.max_steps)
                for s in range(t.max_steps)]
        assert got == pytest.approx(want, rel=1e-12)
        assert got[-1] == pytest.approx(t.min_lr, rel=1e-12)  # min_lr at the last step
    assert [r["lr"] for r in train_rows(base)] != [r["lr"] for r in train_rows(var)]


def check_weights(base, var, cb, cv):
    a, b = load_ckpt(base)[0], load_ckpt(var)[0]
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a), "final weights identical"


def check_losses(base, var, cb, cv):
    la, lb = [r["loss"] for r in train_rows(base)], [r["loss"] for r in train_rows(var)]
    assert la != lb and all(math.isfinite(x) for x in la + lb)
    return la, lb


def check_bf16(base, var, cb, cv):
    la, lb = check_losses(base, var, cb, cv)
    assert la == pytest.approx(lb, abs=0.05)  # bf16 autocast: different, but only a little


def check_eval_steps(base, var, cb, cv):
    for d, c in ((base, cb), (var, cv)):
        n, k = c.train.max_steps, c.train.eval_interval
        assert [r["step"] for r in metrics(d, "eval")] == sorted({*range(0, n + 1, k), n})


def check_val_loss(base, var, cb, cv):
    assert metrics(base, "eval")[0]["val_loss"] != metrics(var, "eval")[0]["val_loss"]


def check_train_steps(base, var, cb, cv):
    for d, c in ((base, cb), (var, cv)):
        n, k = c.train.max_steps, c.train.log_interval
        assert [r["step"] for r in train_rows(d)] == sorted({*range(k, n + 1, k), n})


def check_ckpts(base, var, cb, cv):
    for d, c in ((base, cb), (var, cv)):
        n, k = c.train.max_steps, c.train.ckpt_interval
        steps = sorted({*range(k, n + 1, k), n})[-c.train.keep_checkpoints:]
        assert ckpt_dirs(d) == [f"step_{s:06d}" for s in steps]


def check_fused(base, var, cb, cv):
    # the optimizer's own record of how it ran (state.json keeps its param_groups)
    import json

    for d, c in ((base, cb), (var, cv)):
        groups = json.loads((final_ckpt(d) / "state.json").read_text())["param_groups"]
        assert all(bool(g["fused"]) == c.train.fused_adamw for g in groups)
    a, b = load_ckpt(base)[0], load_ckpt(var)[0]
    for k in a:  # the same algorithm: equal up to rounding
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)


def check_test_eval(base, var, cb, cv):
    import json

    for d, c in ((base, cb), (var, cv)):
        summary = json.loads((d / "summary.json").read_text())
        assert ("test_loss" in summary) == c.train.test_eval
        assert (d / "test_docs.json").is_file() == c.train.test_eval


# key -> (the other value, check); the base is tests/helpers.py TINY. Keys not in this table
# are tested below (objective, mlm_prob, prefix_frac, device, compile) or in test_dist.py
# (parallel); test_every_key_is_tested keeps the list complete.
CASES = {
    "train.micro_batch": (2, check_tokens),
    "train.grad_accum": (3, check_tokens),
    "train.max_steps": (4, check_final_step),
    "train.lr": (3e-3, check_lr),
    "train.min_lr": (0.0, check_lr),
    "train.warmup_steps": (0, check_lr),
    "train.beta1": (0.5, check_weights),
    "train.beta2": (0.9, check_weights),
    "train.eps": (1e-3, check_weights),
    "train.weight_decay": (0.0, check_weights),
    "train.decay_embeddings": (False, check_weights),
    "train.grad_clip": (0.05, check_weights),
    "train.seed": (1, check_weights),
    "data.seed": (8, check_weights),
    "model.dropout": (0.2, check_weights),
    "train.precision": ("bf16", check_bf16),
    "train.eval_interval": (2, check_eval_steps),
    "train.eval_batches": (3, check_val_loss),
    "train.log_interval": (4, check_train_steps),
    "train.ckpt_interval": (2, check_ckpts),
    "train.keep_checkpoints": (1, check_ckpts),
    "train.fused_adamw": (False, check_fused),
    "train.test_eval": (False, check_test_eval),
}
ELSEWHERE = {"objective", "mlm_prob", "prefix_frac", "device", "compile", "parallel",
             "wandb_project",  # below
             "init_from",  # tests/test_init_from.py
             "threads",  # tests/robustness/test_threads.py
             "compile_mode"}  # tests/test_gpu_paths.py


def test_every_key_is_tested():
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    covered = {k.split(".")[1] for k in CASES if k.startswith("train.")} | ELSEWHERE
    assert keys == covered, f"TrainConfig keys without a test: {sorted(keys - covered)}"


@pytest.mark.parametrize("key", sorted(CASES))
def test_key_is_honoured(key, runs, data):
    value, check = CASES[key]
    cb, cv = tiny_config(data), tiny_config(data, **{key: value})
    assert cb != cv
    check(runs(), runs(**{key: value}), cb, cv)


def test_base_run_is_deterministic(runs, data, tmp_path):
    """The comparisons above mean something only if equal configs give equal runs."""
    train(tiny_config(data), tmp_path / "again", progress=False)
    a, b = load_ckpt(runs())[0], load_ckpt(tmp_path / "again")[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cuda_without_cuda_is_an_error(data, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(NlqError, match="CUDA"):
        train(tiny_config(data, **{"train.device": "cuda"}), tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_mlm_encoder_trains_on_masked_tokens(data, tmp_path, monkeypatch):
    """objective mlm + arch encoder: finite falling loss, targets on ~mlm_prob of tokens."""
    seen = {}
    real = batches.mlm_corrupt

    def spy(tokens, seed, key, prob, mask_id, vocab_size, first_row):
        x, y = real(tokens, seed, key, prob, mask_id, vocab_size, first_row)
        s = seen.setdefault(prob, [0, 0, 0])
        s[0] += int((y >= 0).sum())
        s[1] += y.numel()
        s[2] += int((x == mask_id).sum())
        return x, y

    monkeypatch.setattr(batches, "mlm_corrupt", spy)
    for prob in (0.15, 0.4):
        # micro_batch 16: at 0.15 the tiny batch holds ~20 targets a step and its 8 val
        # windows ~20 in all, too few for 30 steps to show a fall whatever the masks drawn
        cfg = tiny_config(data, **{"model.arch": "encoder", "train.objective": "mlm",
                                   "train.mlm_prob": prob, "train.max_steps": 30,
                                   "train.micro_batch": 16})
        train(cfg, tmp_path / f"mlm{prob}", progress=False)
        losses = [r["loss"] for r in metrics(tmp_path / f"mlm{prob}", "train")]
        assert all(math.isfinite(x) for x in losses)
        val = [r["val_loss"] for r in metrics(tmp_path / f"mlm{prob}", "eval")]
        assert val[-1] < val[0]
        targets, total, masked = seen[prob]
        assert targets / total == pytest.approx(prob, abs=0.05)
        assert masked / targets == pytest.approx(0.8, abs=0.1)  # BERT's 80% [MASK]


def test_a_masked_lm_trains_alike_under_any_micro_batch_split(data, tmp_path):
    """The step's objective is the mean over all its masked targets: 8 windows as 8 x 1, 4 x 2
    or 1 x 8 micro-batches (each holding its own number of targets, some none) train the
    same weights, to rounding (a mean per micro-batch averaged over them differed by ~0.1 in
    the first loss)."""
    from safetensors.torch import load_file

    weights, first = [], []
    for mb, ga in ((8, 1), (4, 2), (1, 8)):
        cfg = tiny_config(data, **{"model.arch": "encoder", "train.objective": "mlm",
                                   "train.mlm_prob": 0.15, "train.micro_batch": mb,
                                   "train.grad_accum": ga, "train.max_steps": 6,
                                   "train.eval_batches": 8 // mb, "train.grad_clip": 0.0})
        train(cfg, tmp_path / f"mb{mb}", progress=False)
        weights.append(load_file(str(final_ckpt(tmp_path / f"mb{mb}") / "model.safetensors")))
        first.append(metrics(tmp_path / f"mb{mb}", "train")[0]["loss"])
    assert first[1] == pytest.approx(first[0], rel=1e-6)
    assert first[2] == pytest.approx(first[0], rel=1e-6)
    for w in weights[1:]:
        assert max((w[k] - weights[0][k]).abs().max().item() for k in w) < 1e-5


@pytest.mark.parametrize("arch,objective", [("encoder", "clm"), ("decoder", "mlm"),
                                            ("prefix", "mlm")])
def test_objective_arch_mismatch_is_an_error(data, arch, objective):
    with pytest.raises(NlqError, match="objective"):
        tiny_config(data, **{"model.arch": arch, "train.objective": objective})


def test_prefix_frac_changes_the_loss(runs):
    a = metrics(runs(**{"model.arch": "prefix", "train.prefix_frac": 0.25}), "train")
    b = metrics(runs(**{"model.arch": "prefix", "train.prefix_frac": 0.75}), "train")
    assert a[0]["loss"] != b[0]["loss"]
    assert all(math.isfinite(r["loss"]) for r in a + b)


@pytest.mark.slow
def test_compile_matches_eager(runs):
    a, b = load_ckpt(runs())[0], load_ckpt(runs(**{"train.compile": True}))[0]
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=0)


# -- optimizer groups -----------------------------------------------------------------------


@pytest.mark.parametrize("decay_embeddings", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_weight_decay_on_matrices_only(data, decay_embeddings, tied):
    cfg = tiny_config(data, **{"model.bias": True, "model.query": "nonlinear",
                               "model.tie_embeddings": tied,
                               "train.decay_embeddings": decay_embeddings})
    model = Transformer(cfg.model)
    opt = make_optimizer(model, cfg.train, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay and no_decay["weight_decay"] == 0.0
    in_decay = {id(p) for p in decay["params"]}
    in_no_decay = {id(p) for p in no_decay["params"]}
    names = dict(model.named_parameters())
    assert in_decay | in_no_decay == {id(p) for p in names.values()}
    assert not in_decay & in_no_decay
    embeddings = {"wte.weight", "wpe.weight"}
    for name, p in names.items():
        want = p.dim() == 2 and (decay_embeddings or name not in embeddings)
        assert (id(p) in in_decay) == want, name
    # norms (LayerNorm, the nonlinear query's RMSNorm/LayerNorm) and biases never decay
    assert any(n.endswith(".bias") for n in names) and any("norm" in n or "ln" in n for n in names)
    assert model.lm_head.weight is model.wte.weight or id(model.lm_head.weight) in in_decay


# -- learning and evaluation ----------------------------------------------------------------


def test_val_loss_falls(runs):
    rows = metrics(runs(**{"train.max_steps": 50, "train.eval_interval": 25,
                           "train.ckpt_interval": 50}), "eval")
    assert [r["step"] for r in rows] == [0, 25, 50]
    first, last = rows[0]["val_loss"], rows[-1]["val_loss"]
    assert first == pytest.approx(math.log(320), abs=0.3)  # near-uniform at init
    assert last < first - 0.5, (first, last)


@pytest.mark.parametrize("arch", ["decoder", "prefix"])
def test_val_loss_is_nats_over_tokens(runs, data, arch):
    """Recompute the final val loss from the saved weights on the fixed val windows."""
    over = {"model.arch": arch, "train.eval_batches": 3}
    d, cfg = runs(**over), tiny_config(data, **over)
    m, t = cfg.model, cfg.train
    model = Transformer(m)
    model.load_weights(load_file(str(final_ckpt(d) / "model.safetensors")))
    model.eval()
    T = m.block_size
    windows = val_windows(TokenData.open(data).val, cfg.data.seed,
                          t.eval_batches * t.micro_batch, T)
    prefix = int(t.prefix_frac * T) if arch == "prefix" else 0
    nats, count = 0.0, 0
    with torch.no_grad():
        for w in windows.split(t.micro_batch):  # (B, T+1)
            logits, _ = model(w[:, :-1], prefix_len=prefix if arch == "prefix" else None)
            logp = torch.log_softmax(logits.double(), -1)  # (B, T, V)
            nll = -logp.gather(-1, w[:, 1:, None]).squeeze(-1)  # (B, T)
            nats += nll[:, prefix:].sum().item()
            count += nll[:, prefix:].numel()
    last = metrics(d, "eval")[-1]
    assert last["step"] == t.max_steps
    assert last["val_loss"] == pytest.approx(nats / count, abs=1e-5)
    assert last["val_ppl"] == pytest.approx(math.exp(nats / count), rel=1e-4)


def test_without_a_bar_a_run_prints_plain_lines_and_logs_peak_memory(data, tmp_path, capsys):
    cfg = tiny_config(data, **{"train.max_steps": 100, "train.log_interval": 1,
                               "train.eval_interval": 50, "train.ckpt_interval": 50})
    train(cfg, tmp_path / "run", progress=False)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    # every 2 steps (100 // 50), the last included; each with its measured figures
    assert [ln.split(":")[0] for ln in lines] == [f"step {s}/100" for s in range(2, 101, 2)]
    assert all("tok/s" in ln and "ETA" in ln and "peak mem" in ln for ln in lines)
    rows = [r for r in helpers.metrics(tmp_path / "run", "train")]
    assert len(rows) == 100 and all(r["peak_mem_mb"] > 0 for r in rows)
    last = rows[-1]
    assert f"loss {last['loss']:.4f}" in lines[-1]


class FakeWandb:
    """Stands in for the wandb package: records what a run sends it."""

    def __init__(self):
        self.inits, self.rows, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, values, step):
        self.rows.append((step, values))

    def finish(self):
        self.finished += 1


def test_wandb_mirrors_every_metrics_row(data, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = tiny_config(data, **{"train.wandb_project": "nlq-test"})
    train(cfg, tmp_path / "run", progress=False)
    rows = helpers.metrics(tmp_path / "run")
    assert [step for step, _ in fake.rows] == [r["step"] for r in rows]
    for (_, values), r in zip(fake.rows, rows):
        assert values == {f"{r['kind']}/{k}": v for k, v in r.items()
                          if k not in ("kind", "step") and isinstance(v, (int, float))}
    (init,) = fake.inits
    assert init["project"] == "nlq-test" and init["resume"] == "allow"
    assert init["id"] == (tmp_path / "run" / "wandb_id").read_text().strip()
    assert init["config"] == cfg.to_dict() and fake.finished == 1


def test_wandb_asked_for_but_not_installed_is_one_error(data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = tiny_config(data, **{"train.wandb_project": "p"})
    with pytest.raises(NlqError, match=r"train.wandb_project.*nlq\[wandb\]"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_model_is_freed_before_the_process_group_is_torn_down(data, tmp_path, monkeypatch):
    """Under torchrun a DDP model freed after destroy_process_group can deadlock at exit (its
    reducer's gloo group is destroyed holding the GIL while a worker thread waits for it), so
    train() must drop its model before dist.teardown: checked here with a weak reference."""
    import weakref

    from nlq.train import loop

    refs, alive_at_teardown = [], []
    set_up, teardown = loop.set_up, loop.dist.teardown

    def spy_set_up(*args, **kwargs):
        run = set_up(*args, **kwargs)
        refs.append(weakref.ref(run.wrapped))
        return run

    def spy_teardown(world):
        alive_at_teardown.append(refs[0]() is not None)
        teardown(world)

    monkeypatch.setattr(loop, "set_up", spy_set_up)
    monkeypatch.setattr(loop.dist, "teardown", spy_teardown)
    train(tiny_config(data), tmp_path / "run", progress=False)
    assert alive_at_teardown == [False]


def test_summary_records_the_attention_logit_range(runs, data):
    """Every run's summary holds each layer's largest |attention logit| and their sd; the
    measurement itself: doubling the attention scale of the same weights doubles both, and a
    QK-norm model at init stays within its bound sqrt(hs) * scale multiplier (gains at 1)."""
    import json
    import types

    from nlq.run.scoring import attention_logit_range

    cfg = tiny_config(data)
    rec = json.loads((runs() / "summary.json").read_text())["attn_logits"]
    assert len(rec["max_abs"]) == len(rec["sd"]) == cfg.model.n_layer
    assert all(a > s > 0 for a, s in zip(rec["max_abs"], rec["sd"]))

    x = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.block_size),
                      generator=torch.Generator().manual_seed(0))
    fake = types.SimpleNamespace(val_chunk=lambda i: (x, x), prefix_len=None)
    import contextlib

    def measure(**kw):
        m = Transformer(dataclasses.replace(cfg.model, **kw), seed=1)
        return attention_logit_range(m, fake, contextlib.nullcontext())

    one, two = measure(), measure(attn_scale_mult=2.0)
    for key in ("max_abs", "sd"):
        assert two[key] == pytest.approx([2 * v for v in one[key]], rel=1e-3)
    hs = cfg.model.d_model // cfg.model.n_head
    for mult in (1.0, 4.0):
        got = measure(qk_norm=True, attn_scale_mult=mult)["max_abs"]
        assert max(got) <= math.sqrt(hs) * mult * 1.001
        assert max(got) > 0.1 * math.sqrt(hs) * mult  # measured, not zero
