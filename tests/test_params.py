"""Exact parameter counts: `nlq params` prints the paper's table (docs/paper.md, "Parameter
counts"), the counts equal a closed form and a real model's count, and grow_non_embedding_pct
picks the closest width.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nlq.cli import main
from nlq.config import ModelConfig, load_config
from nlq.experiments.arms import resolve_arm
from nlq.experiments.experiment import experiment_arms, load_experiment, shipped_experiments
from nlq.model.params import count_params, mlp_width_for_pct
from nlq.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]

# docs/paper.md, "Parameter counts" (name, query, mlp, total, non-embedding, vs baseline %);
# residual's count is linear's (docs/paper.md, "The other arms": Q = X + X W_Q)
COUNTS = [
    ("linear", "linear", 3072, 124_373_760, 84_953_856, 0.0),
    ("nonlinear", "nonlinear", 3072, 124_392_192, 84_972_288, 0.022),
    ("linear+12.5%", "linear", 3648, 134_990_592, 95_570_688, 12.497),
    ("identity", "identity", 3072, 117_295_872, 77_875_968, -8.331),
    ("residual", "residual", 3072, 124_373_760, 84_953_856, 0.0),
]


def nlq(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "nlq", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def json_run():
    p = nlq("params", "--preset", "gpt3-small", "--json")  # a real subprocess, as a user runs it
    stdout, stderr = p.communicate(timeout=120)
    return p.returncode, stdout, stderr


def test_nlq_params_json_is_the_paper_table(json_run):
    rc, stdout, stderr = json_run
    assert rc == 0, stderr
    lines = stdout.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object
    obj = json.loads(lines[0])
    assert set(obj) == {"experiment", "preset", "arms"}
    assert (obj["experiment"], obj["preset"]) == ("paper", "gpt3-small")
    keys = {"name", "query", "mlp_hidden", "total", "non_embedding", "vs_baseline_pct"}
    for arm in obj["arms"]:
        assert set(arm) == keys
    got = [(a["name"], a["query"], a["mlp_hidden"], a["total"], a["non_embedding"],
            a["vs_baseline_pct"]) for a in obj["arms"]]
    assert got == COUNTS


def test_nlq_params_text_table_rows(capsys):
    assert main(["params", "--preset", "gpt3-small"]) == 0  # in-process: same code path
    stdout = capsys.readouterr().out
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == [
        "| arm | MLP | total | non-embedding | vs linear |",
        "| linear | 3072 | 124,373,760 | 84,953,856 | - |",
        "| nonlinear | 3072 | 124,392,192 | 84,972,288 | +0.022% |",
        "| linear +12.5% (computed) | 3648 | 134,990,592 | 95,570,688 | +12.497% |",
        "| identity | 3072 | 117,295,872 | 77,875,968 | -8.331% |",
        "| residual | 3072 | 124,373,760 | 84,953,856 | 0% |",
    ]
    # the arm that differs from linear+12.5% in its lr only is named, not counted twice
    assert "linear+12.5%-lr: the model of linear+12.5%" in stdout
    assert "nonlinear-official: the model of nonlinear" in stdout


# ---------------------------------------------------------------------------------------
# the counts against a closed form and a real model


def closed_form(cfg: ModelConfig) -> tuple[int, int]:
    """Count by hand. Per block: 2 LayerNorms, q, k, v, o, MLP; plus ln_f and embeddings."""
    C, H, L, b = cfg.d_model, cfg.mlp_width, cfg.n_layer, int(cfg.bias)
    kv = cfg.kv_heads * cfg.head_dim
    ln = C * (1 + b)
    r = cfg.query_args.get("rank", C // 2)  # the nonlinear query's rank, d/2 by default
    out_norm = {"layernorm": ln, "rmsnorm": C, "none": 0}  # a query's output norm
    query = {
        "linear": C * C + b * C + out_norm[cfg.query_args.get("out_norm", "none")],
        "residual": C * C + b * C,
        "identity": 0,
        # in RMSNorm (gain only) + W1 + W2 + out LayerNorm
        "nonlinear": C + (C * r + b * r) + (r * C + b * C)
        + out_norm[cfg.query_args.get("out_norm", "layernorm")],
    }[cfg.query]
    attn = query + 2 * (C * kv + b * kv) + C * C + b * C
    mlp = C * H + b * H + H * C + b * C
    non_emb = L * (2 * ln + attn + mlp) + ln
    if not cfg.tie_embeddings:
        non_emb += cfg.vocab_size * C
    emb = cfg.vocab_size * C + (cfg.block_size * C if cfg.pos_emb == "learned" else 0)
    return non_emb + emb, non_emb


@pytest.fixture(scope="module")
def gpt3_arms():
    return experiment_arms(load_experiment("paper"), "gpt3-small")


@pytest.mark.parametrize("arm", [a[0] for a in COUNTS])
def test_paper_arms_match_closed_form(arm, gpt3_arms):
    cfg = gpt3_arms[arm].model
    assert count_params(cfg) == closed_form(cfg)


@pytest.mark.parametrize(
    "kw",
    [{"query": "linear"}, {"query": "nonlinear", "bias": True}, {"query": "identity"},
     {"query": "residual", "tie_embeddings": False}, {"query": "nonlinear", "n_kv_head": 2},
     {"query": "linear", "pos_emb": "rope", "n_kv_head": 1},
     {"query": "nonlinear", "query_args": {"rank": 5}},
     {"query": "linear", "query_args": {"out_norm": "layernorm"}, "bias": True},
     {"query": "nonlinear", "query_args": {"out_norm": "none"}}],
    ids=str,
)
def test_count_params_equals_real_model_and_closed_form(kw):
    cfg = ModelConfig(vocab_size=100, block_size=16, n_layer=2, n_head=4, d_model=32,
                      mlp_hidden=48, **kw)
    m = Transformer(cfg)
    real = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
    total, non_emb = count_params(cfg)
    assert total == real == m.num_params()
    assert (total, non_emb) == closed_form(cfg)


def test_tied_head_counts_once_untied_head_is_non_embedding():
    cfg = ModelConfig(vocab_size=100, block_size=16, n_layer=1, n_head=4, d_model=32)
    tied, untied = count_params(cfg), count_params(dataclasses.replace(cfg, tie_embeddings=False))
    assert untied[0] - tied[0] == 100 * 32
    assert untied[1] - tied[1] == 100 * 32


# ---------------------------------------------------------------------------------------
# arms: the computed MLP width


def test_grow_12_5_pct_on_gpt3_small_is_3648():
    base = load_config("gpt3-small")
    cfg = resolve_arm(base, {"grow_non_embedding_pct": 12.5})
    assert cfg.model.mlp_hidden == 3648 == int(4.75 * 768)
    assert mlp_width_for_pct(base.model, 12.5) == 3648
    # everything else is the base config
    assert dataclasses.replace(cfg.model, mlp_hidden=3072) == base.model
    assert cfg.train == base.train


@pytest.mark.parametrize("pct", [12.5, 3.0, 50.0, -10.0])
def test_computed_width_on_tiny_is_the_closest(pct):
    base = load_config("tiny").model
    n0 = count_params(base)[1]
    target = n0 * (1 + pct / 100)
    h = mlp_width_for_pct(base, pct)

    def miss(width):
        return abs(count_params(dataclasses.replace(base, mlp_hidden=width))[1] - target)

    assert miss(h) <= miss(h - 1) and miss(h) <= miss(h + 1)
    assert miss(h) < miss(h - 2) and miss(h) < miss(h + 2)


def test_paper_arm_widths_on_tiny():
    arms = experiment_arms(load_experiment("paper"), "tiny")
    assert list(arms) == ["linear", "nonlinear", "nonlinear-official", "linear+12.5%",
                          "linear+12.5%-lr", "identity", "residual"]
    assert arms["linear+12.5%"].model.mlp_hidden == 608  # 4.75 x 128, as 3648 = 4.75 x 768
    # one recipe for every arm: each differs from the baseline where its architecture does
    lin = arms["linear"]
    for name in ("nonlinear", "linear+12.5%", "identity", "residual"):
        assert arms[name].train == lin.train and arms[name].data == lin.data, name
    assert arms["nonlinear"].model == dataclasses.replace(lin.model, query="nonlinear")
    official = arms["nonlinear-official"]
    assert official.model == arms["nonlinear"].model
    assert official.train != lin.train  # the official config's recipe: other lr and wd
    assert {a.model.query for a in arms.values()} == {"linear", "nonlinear", "identity",
                                                      "residual"}


def test_each_arm_is_one_recipe_in_every_experiment():
    """An arm named in two experiments is the same config in both (arms.toml holds it once);
    on gpt3-small the official nonlinear recipe is 4/3 of the baseline lr, 8e-4, with weight
    decay 0.05, and the nonlinear arm is the baseline's recipe."""
    seen: dict[str, object] = {}
    for name in shipped_experiments():
        exp = load_experiment(name)
        if exp.base:  # e.g. the encoder: another model, the same recipes on top of it
            continue
        for arm, cfg in experiment_arms(exp, "gpt3-small").items():
            assert seen.setdefault(arm, cfg) == cfg, (name, arm)
    nl = seen["nonlinear-official"].train
    assert (nl.lr, nl.min_lr, nl.weight_decay) == (pytest.approx(8e-4), pytest.approx(8e-5), 0.05)
    assert seen["nonlinear"].train == seen["linear"].train
    assert seen["linear"].train.lr == 6e-4


def test_lr_scale_arm_scales_lr_and_min_lr():
    base = load_config("gpt3-small")
    cfg = resolve_arm(base, {"grow_non_embedding_pct": 12.5, "lr_scale": 1 / 1.125 ** 0.5})
    assert cfg.train.lr == pytest.approx(6e-4 / 1.125 ** 0.5)
    assert cfg.train.min_lr == pytest.approx(6e-5 / 1.125 ** 0.5)
    assert cfg.model.mlp_hidden == 3648


def test_experiment_arms_apply_sets_to_every_arm():
    arms = experiment_arms(load_experiment("paper"), "tiny", {"model.n_layer": 2})
    assert all(a.model.n_layer == 2 for a in arms.values())
    # the computed width is recomputed for the overridden base, not copied from the preset
    base = load_config("tiny", {"model.n_layer": 2}).model
    assert arms["linear+12.5%"].model.mlp_hidden == mlp_width_for_pct(base, 12.5)


def test_count_params_allocates_nothing():
    """A 711M-parameter model (2.8 GB in fp32) is counted exactly without its memory: the
    process's peak RSS grows by far less than the model would take, and the meta device
    does not outlive the count."""
    import resource

    cfg = ModelConfig(vocab_size=50304, block_size=2048, n_layer=12, n_head=16, d_model=2048,
                      query="nonlinear")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    total, non_emb = count_params(cfg)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert (total, non_emb) == closed_form(cfg)
    assert total > 7e8
    assert grown < 512 * 1024, f"peak RSS grew by {grown / 1024:.0f} MiB"
    assert torch.empty(1).device.type == "cpu"


@pytest.mark.parametrize(
    "arm,match",
    [({"grow_non_embedding_pct": "12.5"}, "grow_non_embedding_pct"),
     ({"grow_non_embedding_pct": True}, "grow_non_embedding_pct"),
     ({"lr_scale": 0}, "lr_scale"), ({"lr_scale": -1.0}, "lr_scale"),
     ({"query": "nonlinear"}, "'query'"), ({"model.quary": "nonlinear"}, "model.quary"),
     ({"model.query": "quadratic"}, "model.query")],
)
def test_bad_arm_names_the_key(arm, match):
    from nlq.errors import NlqError

    with pytest.raises(NlqError, match=match):
        resolve_arm(load_config("tiny"), arm, "a")


def test_params_table_of_any_preset_and_experiment_file(tmp_path, monkeypatch):
    from nlq.experiments.experiment import params_table

    (tmp_path / "bare.toml").write_text("[model]\nn_layer = 2\nd_model = 64\nn_head = 4\n"
                                        "vocab_size = 100\nblock_size = 32\n")
    monkeypatch.setattr("nlq.config.load.PRESET_DIR", tmp_path)
    exp = tmp_path / "two.toml"
    exp.write_text('baseline = "identity"\narms = ["identity", "nonlinear"]\n')
    rows = params_table(str(exp), "bare")
    cfg = load_config("bare").model
    counts = {q: count_params(dataclasses.replace(cfg, query=q))[1]
              for q in ("identity", "nonlinear")}
    pct = round(100 * (counts["nonlinear"] - counts["identity"]) / counts["identity"], 3)
    assert [(r["name"], r["non_embedding"], r["vs_baseline_pct"]) for r in rows] == [
        ("identity", counts["identity"], 0.0), ("nonlinear", counts["nonlinear"], pct)]


def test_a_new_arm_combination_is_one_table_entry(tmp_path):
    """A combination no shipped arm has (the nonlinear query + RoPE + QK-norm) is one
    [arms.<name>] table of existing keys, no code: its model has the parameter count of the
    closed form (RoPE drops the position table, QK-norm adds two hs-gains per layer), and it
    trains a few steps to a finite loss."""
    from helpers import make_data

    from nlq.train.loop import train

    exp = tmp_path / "combo.toml"
    exp.write_text('[arms.linear]\n\n[arms."nonlinear-rope-qknorm"]\nmodel.query = "nonlinear"\n'
                   'model.pos_emb = "rope"\nmodel.qk_norm = true\n')
    data = make_data(tmp_path / "data")
    sets = {"model.vocab_size": 320, "model.block_size": 16, "model.n_layer": 2,
            "model.n_head": 2, "model.d_model": 32, "model.mlp_hidden": 64,
            "data.dir": str(data), "train.max_steps": 3, "train.micro_batch": 4,
            "train.eval_interval": 3, "train.eval_batches": 1, "train.device": "cpu",
            "train.test_eval": False}
    arms = experiment_arms(load_experiment(exp), "tiny", sets)
    lin, combo = arms["linear"].model, arms["nonlinear-rope-qknorm"].model
    assert (combo.query, combo.pos_emb, combo.qk_norm) == ("nonlinear", "rope", True)
    C, L, hs, r = combo.d_model, combo.n_layer, combo.head_dim, combo.d_model // 2
    # W_Q (C^2) -> RMSNorm gain + W1 + W2 + LayerNorm (weight; no biases here); + q/k gains
    per_layer = -C * C + (C + C * r + r * C + C) + 2 * hs
    want = count_params(lin)[0] - combo.block_size * C + L * per_layer
    model = Transformer(combo)
    assert count_params(combo)[0] == want == model.num_params()
    summary = train(arms["nonlinear-rope-qknorm"], tmp_path / "run", progress=False)
    assert summary["status"] == "finished" and summary["step"] == 3
    assert summary["params_total"] == want and torch.isfinite(torch.tensor(summary["val_loss"]))


def test_normalisation_arms_differ_from_theirs_by_one_norm_per_layer():
    """linear-qnorm is linear plus a LayerNorm on the query (d per layer without biases);
    nonlinear-noln is nonlinear without f's final LayerNorm (d fewer per layer)."""
    from nlq.experiments.arms import named_arms

    base = load_config("small")
    arms = {n: resolve_arm(base, named_arms()[n], n).model
            for n in ("linear", "linear-qnorm", "nonlinear", "nonlinear-noln")}
    L, C = base.model.n_layer, base.model.d_model
    assert not base.model.bias
    n = {k: count_params(m)[1] for k, m in arms.items()}
    assert n["linear-qnorm"] - n["linear"] == L * C
    assert n["nonlinear"] - n["nonlinear-noln"] == L * C


def test_flops_count_one_output_head_tied_or_not():
    """An untied model has the same matmuls as a tied one (the input table is a lookup
    either way): it was counted as 6 V C FLOPs more per token (27% at GPT-3 small)."""
    import dataclasses

    from nlq.config import load_config
    from nlq.model.params import flops_per_token

    tied = load_config("gpt3-small").model
    untied = dataclasses.replace(tied, tie_embeddings=False)
    assert flops_per_token(untied) == flops_per_token(tied)
