"""Your own query variant: plain-argument query modules, register_query, its own settings in
[model.query_args], and `nlq --import` carrying a user variant into `nlq train` and into the
runs a command starts."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, assert_user_error, make_data, metrics, nlq, ok, tiny_config

from nlq.config import ModelConfig, config_from_toml, from_dict, load_config
from nlq.errors import NlqError
from nlq.model.query import QUERIES, NonlinearQuery, make_query, register_query
from nlq.model.transformer import Transformer

EXAMPLE = ROOT / "examples" / "own_query.py"


def test_plain_arguments_build_the_paper_query():
    q = NonlinearQuery(d_model=64, rank=32)
    assert q.w1.weight.shape == (32, 64) and q.w2.weight.shape == (64, 32)
    cfg = ModelConfig(d_model=64, n_head=4, query="nonlinear",
                      query_args={"rank": 32, "half": "explicit"})
    from_cfg = make_query(cfg)
    from_cfg.load_state_dict(q.state_dict())
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert torch.equal(q(x), from_cfg(x))
        assert torch.allclose(q(x), 0.5 * (x + q.f(x)), atol=1e-6)  # the 1/2 applied here
    with pytest.raises(TypeError, match="d_model"):
        NonlinearQuery()


def test_register_query_makes_the_name_valid_and_refuses_clashes():
    class Twice(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()

        def forward(self, x):
            return 2 * x

    with pytest.raises(NlqError, match="twice"):
        load_config("tiny", {"model.query": "twice"})
    register_query("twice", Twice)
    try:
        assert load_config("tiny", {"model.query": "twice"}).model.query == "twice"
        with pytest.raises(ValueError, match="registered already"):
            register_query("linear", Twice)
    finally:
        QUERIES.pop("twice")


class Scaled(torch.nn.Module):
    """A variant with settings of its own: Q = gain * X W, W of `width` rows then padded."""

    def __init__(self, cfg, *, width: int, gain: float = 1.0):
        super().__init__()
        self.gain = gain
        self.proj = torch.nn.Linear(cfg.d_model, width, bias=False)
        self.pad = cfg.d_model - width

    def forward(self, x):
        return self.gain * torch.nn.functional.pad(self.proj(x), (0, self.pad))


@pytest.fixture
def scaled():
    register_query("scaled", Scaled)
    yield
    QUERIES.pop("scaled")


def test_query_args_reach_the_module_and_round_trip(scaled, tmp_path):
    sets = {"model.query": "scaled", "model.query_args.width": 8, "model.query_args.gain": 2.5}
    cfg = load_config("tiny", sets)
    assert cfg.model.query_args == {"width": 8, "gain": 2.5}
    q = make_query(cfg.model)
    assert (q.proj.out_features, q.gain) == (8, 2.5)
    # the TOML a run writes holds the table; TOML, JSON and pickle give the same config back
    assert "[model.query_args]\nwidth = 8\ngain = 2.5\n" in cfg.to_toml()
    assert config_from_toml(cfg.to_toml()) == cfg == from_dict(json.loads(cfg.to_json()))
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(load_config("tiny", sets))
    with pytest.raises(TypeError, match="read-only"):
        cfg.model.query_args["width"] = 4
    # a saved model's config.json carries it too
    m = Transformer(cfg.model, seed=0)
    m.save_pretrained(tmp_path / "m")
    assert Transformer.from_pretrained(tmp_path / "m").cfg == cfg.model
    # a dict given in code is frozen too, and the default writes no table
    assert hash(ModelConfig(query="scaled", query_args={"width": 4}))
    assert "query_args" not in load_config("tiny").to_toml()


@pytest.mark.parametrize("sets,key", [
    ({"model.query_args.widht": 8}, "model.query_args.widht"),  # a typo, caught at load
    ({}, "model.query_args.width"),  # a setting without a default, left out
    ({"model.query_args.width": 8, "model.query_args.gain": [1]}, "model.query_args.gain"),
    ({"model.query_args": 8}, "model.query_args"),
    ({"model.query_args.width": 8, "model.query": "nonlinear"}, "model.query_args.width"),
])
def test_bad_query_args_name_the_key(scaled, sets, key):
    with pytest.raises(NlqError, match=key.replace(".", r"\.")):
        load_config("tiny", {"model.query": "scaled", **sets})


def test_a_user_variant_trains_through_the_cli_and_in_child_processes(tmp_path):
    data = make_data(tmp_path / "data")
    text = tiny_config(data).to_toml()  # validated here, where "gated" is not registered
    assert 'query = "linear"' in text
    cfg = tmp_path / "c.toml"
    cfg.write_text(text.replace('query = "linear"', 'query = "gated"'))
    # without the import the variant is unknown, named in the error
    assert_user_error(nlq("train", cfg, "--out", tmp_path / "x"), "gated")
    ok(nlq("--import", EXAMPLE, "train", cfg, "--out", tmp_path / "run", "--no-progress"))
    rows = metrics(tmp_path / "run", "train")
    assert rows and all(r["loss"] == r["loss"] for r in rows)  # finite: no NaN
    # a run started by another nlq command inherits the import through NLQ_IMPORT
    ok(nlq("train", cfg, "--out", tmp_path / "child", "--no-progress", NLQ_IMPORT=EXAMPLE))
    assert metrics(tmp_path / "child", "train")[-1]["loss"] == rows[-1]["loss"]
    # [model.query_args] in the TOML reaches the module: rank = 4 makes the gate low-rank
    low = tmp_path / "low.toml"
    low.write_text(cfg.read_text() + "\n[model.query_args]\nrank = 4\n")
    ok(nlq("--import", EXAMPLE, "train", low, "--out", tmp_path / "low", "--no-progress"))
    assert "[model.query_args]\nrank = 4\n" in (tmp_path / "low" / "config.toml").read_text()
    full_n, low_n = (summary(tmp_path / d)["params_total"] for d in ("run", "low"))
    C, L = 32, 1  # tiny_config: d_model, n_layer
    assert full_n - low_n == L * (C * C - 2 * C * 4)
    assert metrics(tmp_path / "low", "train")[-1]["loss"] != rows[-1]["loss"]
    # a typo is an error naming the key, before any run dir is made
    assert_user_error(nlq("--import", EXAMPLE, "train", cfg, "--set", "model.query_args.rnk=4",
                          "--out", tmp_path / "typo"), "model.query_args.rnk")
    assert not (tmp_path / "typo").exists()
    assert_user_error(nlq("--import", "no_such_module_xyz", "params"), "no_such_module_xyz")
    assert_user_error(nlq("--import", tmp_path / "none.py", "params"), "none.py")


def test_the_plain_pytorch_example_runs():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "nonlinear_in_your_model.py")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("loss after 20 steps:")


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())
