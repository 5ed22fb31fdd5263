"""Old configs against new ones: the nonlinear query's settings moved from [model] keys
(nl_rank, nl_act, nl_in_norm, nl_out_norm, nl_half) into model.query_args, and an old
config, run dir or checkpoint must still load to the same model (nlq/model/config.py,
upgrade). Each test compares the model an old spelling builds with the one the new spelling
builds, or with numbers the old code wrote (results/*/summary.json) or gave."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from nlq.config import config_from_toml, load_config, model_config_from_dict
from nlq.errors import NlqError
from nlq.model.config import LEGACY_KEYS, ModelConfig
from nlq.model.params import count_params
from nlq.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results" / "superseded" / "paper-small" / "runs"
# Per-block parameter names the old code gave these arms (read from it before the move)
OLD_BLOCK_NAMES = {
    "linear": ["attn.k_proj.weight", "attn.o_proj.weight", "attn.q.proj.weight",
               "attn.v_proj.weight", "ln_1.weight", "ln_2.weight", "mlp.fc.weight",
               "mlp.proj.weight"],
    "nonlinear": ["attn.k_proj.weight", "attn.o_proj.weight", "attn.q.in_norm.weight",
                  "attn.q.out_norm.weight", "attn.q.w1.weight", "attn.q.w2.weight",
                  "attn.v_proj.weight", "ln_1.weight", "ln_2.weight", "mlp.fc.weight",
                  "mlp.proj.weight"],
}


def names(cfg: ModelConfig) -> list[str]:
    with torch.device("meta"):
        return [n for n, _ in Transformer(cfg, seed=0).named_parameters()]


@pytest.mark.parametrize("arm", ["linear", "nonlinear", "linear+12.5%"])
def test_a_committed_old_run_config_builds_the_model_it_trained(arm):
    """results/superseded/paper-small's config.toml files hold the old nl_* keys: they load,
    and the model has the parameter count the old code recorded in the run's summary.json and
    the parameter names it gave."""
    run = RUNS / arm / "seed0"
    text = (run / "config.toml").read_text()
    assert "nl_half" in text  # written before the move
    cfg = load_config(run / "config.toml")
    assert cfg.model.query_args == {}  # every nl_* value was the default
    summary = json.loads((run / "summary.json").read_text())
    assert count_params(cfg.model) == (summary["params_total"],
                                       summary["params_non_embedding"])
    got = names(cfg.model)
    block = sorted(n.split(".", 2)[2] for n in got if n.startswith("blocks.0."))
    assert block == OLD_BLOCK_NAMES[cfg.model.query]
    assert [n for n in got if not n.startswith("blocks.")] == ["wte.weight", "wpe.weight",
                                                               "ln_f.weight"]
    # written again by the new code, it reads back to the same config, without nl_* keys
    again = config_from_toml(cfg.to_toml())
    assert again == cfg and not any(k in cfg.to_toml() for k in LEGACY_KEYS)


def test_old_keys_with_values_build_the_model_the_old_code_built():
    """Non-default old keys, given as --set overrides on an old run's config: the same config
    as the new spelling, and the model the old code built from them (its numbers, taken from
    the old code before the move: parameter count, logit scale, the init's sum and a loss)."""
    old = {"model.nl_rank": 8, "model.nl_act": "relu", "model.nl_half": "explicit",
           "model.nl_in_norm": "layernorm"}
    new = {f"model.query_args.{LEGACY_KEYS[k.split('.')[1]]}": v for k, v in old.items()}
    path = RUNS / "nonlinear" / "seed0" / "config.toml"
    a, b = load_config(path, old), load_config(path, new)
    assert a == b
    assert a.model.query_args == {"rank": 8, "act": "relu", "half": "explicit",
                                  "in_norm": "layernorm"}
    m = Transformer(a.model, seed=0)
    q = m.blocks[0].attn.q
    assert (q.w1.weight.shape, q.w2.weight.shape) == ((8, 32), (32, 8))
    assert isinstance(q.act, torch.nn.ReLU) and isinstance(q.in_norm, torch.nn.LayerNorm)
    assert m.num_params() == 68128 and m.blocks[0].attn.scale == 0.25
    init_sum = sum(p.double().sum().item() for p in m.parameters())
    assert init_sum == pytest.approx(545.8809753137502, rel=1e-12)
    torch.manual_seed(0)
    idx = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        loss = m(idx, idx)[1].item()
    assert loss == pytest.approx(5.8193206787109375, rel=1e-6)


def test_old_keys_mean_nothing_for_another_query():
    """Only the nonlinear query read nl_*: for linear they are dropped, as they changed
    nothing."""
    cfg = load_config(RUNS / "linear" / "seed0" / "config.toml", {"model.nl_rank": 8})
    assert cfg == load_config(RUNS / "linear" / "seed0" / "config.toml")


def test_an_old_checkpoint_model_config_matches_the_new_config_on_resume():
    """A checkpoint's model_config (state.json) from before the move has the nl_* keys; read
    as a config, as the training loop compares it on resume, it equals the new config. A new
    checkpoint's (cfg.to_dict()["model"]) reads back to the same config as well."""
    cfg = load_config(RUNS / "nonlinear" / "seed0" / "config.toml")
    old = {k: v for k, v in cfg.to_dict()["model"].items() if k != "query_args"}
    old.update({"nl_rank": None, "nl_act": "gelu", "nl_in_norm": "rmsnorm",
                "nl_out_norm": "layernorm", "nl_half": "fold"})
    assert model_config_from_dict(old) == cfg.model
    assert model_config_from_dict(cfg.to_dict()["model"]) == cfg.model
    ranked = dataclasses.replace(cfg.model, query_args={"rank": 4})
    assert model_config_from_dict({**old, "nl_rank": 4}) == ranked
    assert model_config_from_dict({**old, "nl_rank": 4}) != cfg.model


def test_a_setting_given_both_ways_is_an_error_naming_both():
    with pytest.raises(NlqError, match=r"model\.nl_rank.*model\.query_args\.rank"):
        model_config_from_dict({"query": "nonlinear", "nl_rank": 4, "query_args": {"rank": 8}})


def test_save_pretrained_folder_of_the_old_code_loads(tmp_path):
    """A save_pretrained folder's config.json from before the move (nl_* keys) loads with
    Transformer.from_pretrained to the same model and weights."""
    cfg = ModelConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, d_model=16,
                      query="nonlinear", query_args={"rank": 4})
    m = Transformer(cfg, seed=1)
    m.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("query_args")
    raw.update({"nl_rank": 4, "nl_act": "gelu", "nl_in_norm": "rmsnorm",
                "nl_out_norm": "layernorm", "nl_half": "fold"})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    back = Transformer.from_pretrained(tmp_path)
    assert back.cfg == cfg
    assert all(torch.equal(a, b) for a, b in zip(m.weights().values(),
                                                  back.weights().values()))
