"""Seed pairing: arms built with the same seed share every common tensor's initial values
bitwise, and seed k fixes the data order, the same in every arm."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nlq.config import load_config
from nlq.data.schedule import train_batch
from nlq.experiments.experiment import experiment_arms, load_experiment
from nlq.experiments.reproduce import plan
from nlq.model import Transformer

SMALL = {"model.d_model": 32, "model.n_head": 2, "model.mlp_hidden": 64, "model.n_layer": 2,
         "model.vocab_size": 512}


def _arms(names):
    exp = load_experiment("paper")
    return experiment_arms(exp, "tiny", SMALL, names)


def _state(cfg, seed):
    return {k: v.clone() for k, v in Transformer(cfg.model, seed=seed).state_dict().items()}


def test_common_tensors_are_bitwise_equal_across_arms():
    arms = _arms(["linear", "nonlinear", "linear+12.5%"])
    states = {a: _state(cfg, 7) for a, cfg in arms.items()}
    lin = states["linear"]
    for other in ("nonlinear", "linear+12.5%"):
        common = [k for k in lin if k in states[other] and lin[k].shape == states[other][k].shape]
        differ = [k for k in lin if k not in common]
        assert differ, f"{other} should differ from linear somewhere"
        assert len(common) >= 10
        for k in common:
            assert torch.equal(lin[k], states[other][k]), (other, k)
    # the wider MLP of +12.5% has other shapes; K, V and the MLP's input matrix still match
    # where they share names and shapes
    wide = states["linear+12.5%"]
    assert wide["blocks.0.attn.k_proj.weight"].equal(lin["blocks.0.attn.k_proj.weight"])
    assert wide["blocks.0.mlp.fc.weight"].shape != lin["blocks.0.mlp.fc.weight"].shape


def test_seeds_differ_and_every_tensor_is_drawn_independently():
    cfg = _arms(["linear"])["linear"]
    a, b = _state(cfg, 0), _state(cfg, 1)
    weights = [k for k in a if a[k].dim() == 2]
    assert all(not torch.equal(a[k], b[k]) for k in weights)
    # two tensors of one model are not copies of one another
    assert not torch.equal(a["blocks.0.attn.k_proj.weight"], a["blocks.0.attn.v_proj.weight"])


def test_init_distribution_unchanged():
    cfg = _arms(["linear"])["linear"]
    sd = _state(cfg, 3)
    std = cfg.model.init_std
    w = sd["blocks.0.mlp.fc.weight"]
    assert abs(w.std().item() - std) < 0.15 * std
    resid = sd["blocks.0.attn.o_proj.weight"]
    assert abs(resid.std().item() - std / (2 * cfg.model.n_layer) ** 0.5) < 0.15 * std


def test_global_seed_still_decides_the_init_when_no_seed_is_given():
    cfg = _arms(["linear"])["linear"].model
    torch.manual_seed(0)
    a = Transformer(cfg).state_dict()["wte.weight"].clone()
    torch.manual_seed(0)
    b = Transformer(cfg).state_dict()["wte.weight"].clone()
    torch.manual_seed(1)
    c = Transformer(cfg).state_dict()["wte.weight"].clone()
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_reproduce_seed_k_sets_init_and_data_order_in_every_arm(tmp_path):
    exp = load_experiment("paper")
    specs = plan(exp, "tiny", 3, ["linear", "nonlinear", "linear+12.5%"], tmp_path, SMALL)
    by_seed = {}
    for s in specs:
        by_seed.setdefault(s.seed_index, set()).add((s.cfg.train.seed, s.cfg.data.seed))
    assert all(len(v) == 1 for v in by_seed.values()), by_seed  # one (init, data) per seed
    pairs = [next(iter(by_seed[k])) for k in sorted(by_seed)]
    assert len({p[0] for p in pairs}) == 3 and len({p[1] for p in pairs}) == 3
    base = load_config("tiny")
    assert pairs[0] == (base.train.seed, base.data.seed)
    # the data order of seed 0 and seed 1 differs
    data = torch.arange(10_000).numpy()
    w0 = train_batch(data, pairs[0][1], 0, 0, 4, 1, 16)
    w1 = train_batch(data, pairs[1][1], 0, 0, 4, 1, 16)
    assert not torch.equal(w0, w1)


@pytest.mark.parametrize("device", ["cpu"])
def test_keyed_init_is_the_same_under_meta_counting(device):
    from nlq.model.params import count_params

    cfg = _arms(["linear"])["linear"].model
    total, _ = count_params(cfg)
    assert total == Transformer(cfg, seed=0).num_params()


def test_nested_init_gives_a_wider_mlp_the_narrower_ones_units():
    """model.init_nested: linear+12.5%'s wider MLP starts with linear's values in every
    hidden unit they share (fc's rows, proj's columns), bitwise, and every tensor of the same
    shape is equal; without it proj's shared columns differ (each tensor one row-major
    stream), which is what made the control's seed pairing weak."""
    for nested in (True, False):
        arms = experiment_arms(load_experiment("paper"), "tiny",
                               {**SMALL, "model.init_nested": nested}, ["linear", "linear+12.5%"])
        lin, wide = (_state(arms[a], 5) for a in ("linear", "linear+12.5%"))
        h = arms["linear"].model.mlp_width
        assert arms["linear+12.5%"].model.mlp_width > h
        for k in lin:
            if lin[k].shape == wide[k].shape:
                assert torch.equal(lin[k], wide[k]), k
        fc, proj = "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight"
        if nested:
            assert torch.equal(lin[fc], wide[fc][:h])
        assert torch.equal(lin[proj], wide[proj][:, :h]) == nested
    # the same distribution: per-entry std as the row-major draw's
    cfg = _arms(["linear"])["linear"]
    sd = Transformer(dataclasses.replace(cfg.model, init_nested=True), seed=3).state_dict()
    std = cfg.model.init_std
    assert abs(sd["blocks.0.mlp.fc.weight"].std().item() - std) < 0.15 * std
    resid = sd["blocks.0.mlp.proj.weight"]
    assert abs(resid.std().item() - std / (2 * cfg.model.n_layer) ** 0.5) < 0.15 * std
    assert not torch.equal(sd["blocks.0.mlp.fc.weight"],
                           _state(cfg, 3)["blocks.0.mlp.fc.weight"])  # other values
