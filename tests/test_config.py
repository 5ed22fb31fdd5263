"""Config: TOML/JSON round trips, every bad value an NlqError naming the key, --set
overrides through the same validation, presets named from a file."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nlq.cli import main
from nlq.config import (
    Config,
    ModelConfig,
    TrainConfig,
    config_from_toml,
    from_dict,
    load_config,
    parse_sets,
)
from nlq.errors import NlqError

ROOT = Path(__file__).resolve().parents[1]


def nlq(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "nlq", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---------------------------------------------------------------------------------------
# round trips

NON_DEFAULT = Config(
    model=ModelConfig(arch="prefix", n_layer=3, n_head=6, n_kv_head=2, d_model=96,
                      mlp_hidden=200, bias=True, query="nonlinear", attn_scale=0.0625,
                      nl_rank=7, nl_act="silu", nl_half="explicit", pos_emb="rope",
                      qk_norm=True, dropout=0.1),
    train=TrainConfig(lr=1.5e-3, min_lr=0.0, device="cuda:1", compile=True, warmup_steps=0),
)


@pytest.mark.parametrize("cfg", [Config(), NON_DEFAULT, load_config("tiny"),
                                 load_config("gpt3-small")], ids=["default", "custom", "tiny",
                                                                   "gpt3-small"])
def test_toml_and_json_round_trip(cfg):
    via_toml = config_from_toml(cfg.to_toml())
    via_json = from_dict(json.loads(cfg.to_json()))
    assert via_toml == cfg
    assert via_json == cfg
    # the types survive too (a float stays a float, None stays None)
    for a, b in ((via_toml, cfg), (via_json, cfg)):
        for sec in ("model", "train", "data"):
            for f in dataclasses.fields(getattr(cfg, sec)):
                va, vb = getattr(getattr(a, sec), f.name), getattr(getattr(b, sec), f.name)
                assert type(va) is type(vb), f"{sec}.{f.name}"


def test_unset_optionals_stay_none():
    cfg = config_from_toml(Config().to_toml())
    m = cfg.model
    assert (m.n_kv_head, m.mlp_hidden, m.attn_scale, m.nl_rank) == (None, None, None, None)
    assert "n_kv_head" not in Config().to_toml()  # TOML has no null: the key is absent
    assert json.loads(Config().to_json())["model"]["n_kv_head"] is None
    assert (m.kv_heads, m.mlp_width, m.rank) == (12, 3072, 384)


def test_int_is_accepted_for_float_and_becomes_float():
    cfg = config_from_toml("[train]\nlr = 1\nmin_lr = 0\n")
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert type(cfg.train.min_lr) is float


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().model.n_layer = 3  # type: ignore[misc]


def test_replace_with_dotted_keys_validates():
    cfg = Config().replace(**{"model.query": "nonlinear", "train.lr": 1e-3})
    assert cfg.model.query == "nonlinear" and cfg.train.lr == 1e-3
    assert cfg.model.n_layer == Config().model.n_layer
    with pytest.raises(NlqError, match=re.escape("model.n_head")):
        Config().replace(**{"model.n_head": 7})


# ---------------------------------------------------------------------------------------
# every bad config names its key

BAD = [
    ({"model": {"foo": 1}}, "model.foo"),
    ({"train": {"learning_rate": 1e-3}}, "train.learning_rate"),
    ({"modle": {"n_layer": 2}}, "modle"),
    ({"model": {"n_layer": "12"}}, "model.n_layer"),
    ({"model": {"n_layer": True}}, "model.n_layer"),
    ({"model": {"n_layer": 12.0}}, "model.n_layer"),
    ({"model": {"n_kv_head": 2.5}}, "model.n_kv_head"),
    ({"model": {"bias": 1}}, "model.bias"),
    ({"model": {"query": 3}}, "model.query"),
    ({"train": {"lr": "fast"}}, "train.lr"),
    ({"train": {"lr": True}}, "train.lr"),
    ({"model": {"d_model": 100, "n_head": 12}}, "model.d_model"),
    ({"model": {"nl_rank": 0}}, "model.nl_rank"),
    ({"model": {"nl_rank": -3}}, "model.nl_rank"),
    ({"model": {"n_head": 12, "n_kv_head": 5}}, "model.n_kv_head"),
    ({"model": {"n_head": 4, "n_kv_head": 8}}, "model.n_kv_head"),
    ({"model": {"n_kv_head": 0}}, "model.n_kv_head"),
    ({"model": {"n_layer": 0}}, "model.n_layer"),
    ({"model": {"mlp_hidden": -1}}, "model.mlp_hidden"),
    ({"train": {"lr": -1e-3}}, "train.lr"),
    ({"train": {"lr": 0.0}}, "train.lr"),
    ({"train": {"lr": math.nan}}, "train.lr"),
    ({"train": {"lr": math.inf}}, "train.lr"),
    ({"train": {"min_lr": math.nan}}, "train.min_lr"),
    ({"train": {"lr": 1e-4, "min_lr": 2e-4}}, "train.min_lr"),
    ({"train": {"weight_decay": -0.1}}, "train.weight_decay"),
    ({"model": {"dropout": 1.0}}, "model.dropout"),
    ({"model": {"dropout": 1.5}}, "model.dropout"),
    ({"model": {"dropout": -0.1}}, "model.dropout"),
    ({"model": {"dropout": math.nan}}, "model.dropout"),
    ({"model": {"query": "quadratic"}}, "model.query"),
    ({"model": {"arch": "seq2seq"}}, "model.arch"),
    ({"model": {"pos_emb": "alibi"}}, "model.pos_emb"),
    ({"model": {"nl_act": "swish"}}, "model.nl_act"),
    ({"model": {"pos_emb": "rope", "d_model": 36, "n_head": 4}}, "model.pos_emb"),
    ({"train": {"beta2": 1.0}}, "train.beta2"),
    ({"train": {"device": "tpu"}}, "train.device"),
    ({"train": {"objective": "mlm"}}, "train.objective"),
    ({"model": {"arch": "encoder"}, "train": {"objective": "clm"}}, "train.objective"),
    ({"model": 3}, "model"),
]


@pytest.mark.parametrize("raw,key", BAD, ids=[f"{k}:{json.dumps(r)[:40]}" for r, k in BAD])
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(NlqError, match=re.escape(key)):
        from_dict(raw)


def test_bad_toml_text_names_the_key():
    with pytest.raises(NlqError, match=re.escape("model.n_head")):
        config_from_toml("[model]\nn_head = 'twelve'\n")
    with pytest.raises(NlqError, match="not valid TOML"):
        config_from_toml("[model\n")
    with pytest.raises(NlqError, match=re.escape("train.lr")):
        config_from_toml("[train]\nlr = nan\n")


def test_encoder_with_auto_objective_is_valid():
    cfg = from_dict({"model": {"arch": "encoder"}})
    assert cfg.model.arch == "encoder"


# ---------------------------------------------------------------------------------------
# --set overrides


def test_parse_sets_reads_toml_values():
    got = parse_sets(["train.lr=3e-4", "model.bias=true", "model.query=nonlinear",
                      'data.dir="a b"', "model.n_layer = 6"])
    assert got == {"train.lr": 3e-4, "model.bias": True, "model.query": "nonlinear",
                   "data.dir": "a b", "model.n_layer": 6}
    with pytest.raises(NlqError, match="section.key=value"):
        parse_sets(["model.n_layer"])


@pytest.mark.parametrize(
    "sets,key",
    [(["model.n_layer=2.5"], "model.n_layer"), (["model.n_layr=2"], "model.n_layr"),
     (["n_layer=2"], "n_layer"), (["model.d_model=102"], "model.d_model"),
     (["model.nl_rank=0"], "model.nl_rank"), (["train.lr=-1"], "train.lr"),
     (["model.query=quadratic"], "model.query"), (["model.dropout=1"], "model.dropout"),
     (["train.min_lr=1.0"], "train.min_lr"), (["model.bias=yes"], "model.bias")],
)
def test_sets_go_through_validation(sets, key):
    with pytest.raises(NlqError, match=re.escape(key)):
        load_config("tiny", parse_sets(sets))


def test_good_sets_change_only_their_keys():
    base = load_config("tiny")
    cfg = load_config("tiny", parse_sets(["model.query=nonlinear", "train.lr=1e-3"]))
    assert cfg == base.replace(**{"model.query": "nonlinear", "train.lr": 1e-3})
    assert cfg != base


def test_nlq_params_bad_set_exits_2_with_one_line():
    p = nlq("params", "--preset", "tiny", "--set", "model.n_layer=2.5")  # a real subprocess
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 2
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("nlq: error:") and "model.n_layer" in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "sets,key",
    [(["model.d_model=102"], "model.d_model"), (["train.lr=nan"], "train.lr"),
     (["model.n_heads=2"], "model.n_heads"), (["model.query=1"], "model.query"),
     (["model.n_kv_head=3"], "model.n_kv_head"), (["model.query=quadratic"], "model.query")],
)
def test_cli_bad_set_in_process(capsys, sets, key):
    argv = ["params", "--preset", "tiny"] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and key in err and "Traceback" not in err


def test_cli_good_set_in_process(capsys):
    assert main(["params", "--preset", "tiny", "--json", "--set", "model.n_layer=2"]) == 0
    arms = json.loads(capsys.readouterr().out)["arms"]
    two = {a["name"]: a["non_embedding"] for a in arms}
    assert main(["params", "--preset", "tiny", "--json"]) == 0
    four = {a["name"]: a["non_embedding"] for a in json.loads(capsys.readouterr().out)["arms"]}
    ln_f = load_config("tiny").model.d_model  # the final norm is not per layer
    assert two["linear"] - ln_f == (four["linear"] - ln_f) // 2


# ---------------------------------------------------------------------------------------
# files and presets


def test_load_config_file_with_preset_and_overrides(tmp_path):
    p = tmp_path / "exp.toml"
    p.write_text('preset = "tiny"\n\n[model]\nquery = "nonlinear"\nn_layer = 2\n\n'
                 '[train]\nlr = 1e-3\n')
    cfg = load_config(p, {"train.max_steps": 7, "model.n_layer": 3})
    want = load_config("tiny").replace(**{"model.query": "nonlinear", "model.n_layer": 3,
                                          "train.lr": 1e-3, "train.max_steps": 7})
    assert cfg == want
    tiny = load_config("tiny")
    assert (cfg.model.d_model, cfg.train.min_lr) == (tiny.model.d_model, tiny.train.min_lr)
    assert load_config(str(p)) == want.replace(**{"model.n_layer": 2,
                                                  "train.max_steps": tiny.train.max_steps})


def test_load_config_file_errors_name_the_key(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('preset = "tiny"\n[model]\nn_layers = 2\n')
    with pytest.raises(NlqError, match=re.escape("model.n_layers")):
        load_config(p)
    p.write_text('preset = "nope"\n')
    with pytest.raises(NlqError, match="nope"):
        load_config(p)
    p.write_text("preset = 3\n")
    with pytest.raises(NlqError, match="preset"):
        load_config(p)
    with pytest.raises(NlqError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(NlqError, match="unknown preset"):
        load_config("no-such-preset")


def test_load_config_without_source_is_the_defaults():
    assert load_config() == Config()
    assert load_config(None, {"model.query": "identity"}).model.query == "identity"


def test_folder_named_like_a_preset_does_not_shadow_it(tmp_path, monkeypatch):
    want = load_config("tiny")
    (tmp_path / "tiny").mkdir()  # e.g. a run dir made by `--out tiny`
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny") == want


def test_arms_are_no_config_section(tmp_path):
    """Arms live in experiments (nlq/experiments/arms.toml), never in a config or preset."""
    p = tmp_path / "exp.toml"
    for text in ('preset = "tiny"\n[arms.a]\nmodel.query = "identity"\n', "[arms]\nwide = 3\n",
                 'preset = "tiny"\narms = 3\n'):
        p.write_text(text)
        with pytest.raises(NlqError, match="arms"):
            load_config(p)
