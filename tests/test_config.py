"""Config: TOML/JSON round trips, every bad value an NlqError naming the key, --set
overrides through the same validation, presets named from a file, `nlq config` and every
key's docstring, and the model's registries as the one source of the string choices."""

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
import torch

from nlq.cli import main
from nlq.config import (
    SECTIONS,
    Config,
    ModelConfig,
    TrainConfig,
    config_from_toml,
    from_dict,
    load_config,
    model_config_from_dict,
    parse_sets,
)
from nlq.config.cli import field_docs
from nlq.errors import NlqError
from nlq.model.fast import FastNonlinearQuery
from nlq.model.layers import ACTIVATIONS, NORMS
from nlq.model.query import QUERIES, NonlinearQuery, make_query
from nlq.model.transformer import Transformer

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
                      query_args={"rank": 7, "act": "silu", "half": "explicit"}, pos_emb="rope",
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
    assert (m.n_kv_head, m.mlp_hidden, m.attn_scale) == (None, None, None)
    assert "n_kv_head" not in Config().to_toml()  # TOML has no null: the key is absent
    assert json.loads(Config().to_json())["model"]["n_kv_head"] is None
    assert (m.kv_heads, m.mlp_width) == (12, 3072)


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
    ({"model": {"query": "nonlinear", "query_args": {"rank": 0}}}, "model.query_args"),
    ({"model": {"query": "nonlinear", "nl_rank": -3}}, "model.query_args"),  # an old key
    ({"model": {"query": "nonlinear", "query_args": {"rank": 2.5}}}, "model.query_args"),
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
    ({"model": {"query": "nonlinear", "query_args": {"act": "swish"}}}, "model.query_args"),
    ({"model": {"query": "nonlinear", "nl_act": "swish"}}, "model.query_args"),  # an old key
    ({"model": {"query": "nonlinear", "nl_rank": 8, "query_args": {"rank": 8}}},
     "model.query_args.rank"),  # one setting given the old way and the new
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
     (["model.query=nonlinear", "model.query_args.rank=0"], "model.query_args"),
     (["model.query=nonlinear", "model.nl_rank=0"], "model.query_args"), (["train.lr=-1"], "train.lr"),
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


def test_nlq_config_bad_set_exits_2_with_one_line():
    p = nlq("config", "tiny", "--set", "model.n_layer=2.5")  # a real subprocess
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
    argv = ["config", "tiny"] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and key in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------
# `nlq config`: the resolved config, and every key's docstring


def test_nlq_config_prints_the_resolved_config(capsys, tmp_path):
    assert main(["config", "tiny", "--set", "model.query=nonlinear", "--set",
                 "train.lr=1e-3"]) == 0
    got = config_from_toml(capsys.readouterr().out)
    assert got == load_config("tiny").replace(**{"model.query": "nonlinear", "train.lr": 1e-3})
    p = tmp_path / "exp.toml"
    p.write_text('preset = "tiny"\n[model]\nn_layer = 2\n')
    assert main(["config", str(p)]) == 0
    assert config_from_toml(capsys.readouterr().out) == load_config("tiny").replace(
        **{"model.n_layer": 2})
    assert main(["config"]) == 0
    assert config_from_toml(capsys.readouterr().out) == Config()


def test_every_config_key_has_a_docstring():
    for sec, cls in SECTIONS.items():
        docs = field_docs(cls)
        assert list(docs) == [f.name for f in dataclasses.fields(cls)]
        missing = [f"{sec}.{k}" for k, d in docs.items() if len(d.split()) < 3]
        assert not missing, f"keys without a docstring: {missing}"


def test_field_docs_reads_the_string_under_each_field():
    docs = field_docs(_Documented)
    assert docs == {"a": "The first key,\nover two lines.", "b": "", "c": "Third."}


@dataclasses.dataclass(frozen=True)
class _Documented:
    a: int = 1
    """The first key,
    over two lines."""
    b: str = "x"
    c: float | None = None
    """Third."""


def test_nlq_config_doc_lists_every_key(capsys):
    assert main(["config", "--doc"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert len(lines) == len(keys)
    for key, line in zip(keys, lines):
        sec, name = key.split(".")
        doc = " ".join(field_docs(SECTIONS[sec])[name].split())
        assert line.startswith(f"{key} (") and line.endswith(f"): {doc}"), line
    assert 'model.query (str, "linear"): ' in lines[keys.index("model.query")]
    assert "model.n_kv_head (int | None, unset): " in lines[keys.index("model.n_kv_head")]


# ---------------------------------------------------------------------------------------
# model_config_from_dict (a checkpoint's config.json)


def test_model_config_from_dict_builds_and_converts():
    m = model_config_from_dict({"query": "nonlinear", "n_layer": 3, "attn_scale": 1})
    assert m == ModelConfig(query="nonlinear", n_layer=3, attn_scale=1.0)
    assert type(m.attn_scale) is float
    assert model_config_from_dict(dataclasses.asdict(NON_DEFAULT.model)) == NON_DEFAULT.model


MODEL_BAD = [(r["model"], k) for r, k in BAD if set(r) == {"model"} and isinstance(r["model"],
                                                                                     dict)]


@pytest.mark.parametrize("raw,key", MODEL_BAD, ids=[k for _, k in MODEL_BAD])
def test_model_config_from_dict_names_the_key(raw, key):
    with pytest.raises(NlqError, match=re.escape(key)):
        model_config_from_dict(raw)


def test_model_config_from_dict_rejects_a_non_table():
    with pytest.raises(NlqError, match="model config"):
        model_config_from_dict([1, 2])


# ---------------------------------------------------------------------------------------
# the registries drive validation


@pytest.mark.parametrize("query", sorted(QUERIES))
def test_every_registered_query_is_a_valid_choice(query):
    assert from_dict({"model": {"query": query}}).model.query == query


@pytest.mark.parametrize("key,registry", [("query", QUERIES), ("act", ACTIVATIONS),
                                          ("in_norm", NORMS), ("out_norm", NORMS)])
def test_choice_errors_list_the_registry(key, registry):
    model = ({"query": "quadratic"} if key == "query"
             else {"query": "nonlinear", "query_args": {key: "quadratic"}})
    where = "model.query" if key == "query" else "model.query_args"
    with pytest.raises(NlqError, match=re.escape(where)) as e:
        from_dict({"model": model})
    assert key in str(e.value) and all(name in str(e.value) for name in registry)


class _ScaledLinearQuery(torch.nn.Module):
    """A throwaway variant: Q = 2 X W_Q."""

    scale_factor = 1.0

    def __init__(self, cfg):
        super().__init__()
        self.proj = torch.nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        return 2.0 * self.proj(x)


def test_a_registered_variant_validates_builds_and_trains(monkeypatch):
    """Registering a class in QUERIES is all a new variant needs: config validation accepts
    its name and the model builds with it, runs forward and backward."""
    raw = {"model": {"query": "scaled", "vocab_size": 50, "block_size": 8, "n_layer": 1,
                     "n_head": 2, "d_model": 16, "mlp_hidden": 32}}
    with pytest.raises(NlqError, match="model.query"):
        from_dict(raw)
    monkeypatch.setitem(QUERIES, "scaled", _ScaledLinearQuery)
    cfg = from_dict(raw)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    q = model.blocks[0].attn.q
    assert isinstance(q, _ScaledLinearQuery)
    x = torch.randn(1, 8, 16)
    torch.testing.assert_close(q(x), 2.0 * q.proj(x))
    idx = torch.arange(8)[None] % 50
    _, loss = model(idx, (idx + 1) % 50)
    loss.backward()
    assert torch.isfinite(loss) and q.proj.weight.grad.abs().sum() > 0


def test_a_registered_activation_is_a_valid_choice(monkeypatch):
    monkeypatch.setitem(ACTIVATIONS, "softplus", torch.nn.Softplus)
    cfg = from_dict({"model": {"query": "nonlinear", "query_args": {"act": "softplus"},
                               "d_model": 64, "n_head": 4}})
    q = make_query(cfg.model)  # QUERIES["nonlinear"](cfg, **query_args)
    assert isinstance(q, NonlinearQuery) and isinstance(q.act, torch.nn.Softplus)
    assert not FastNonlinearQuery.fits(q)  # the CPU kernel has GELU only: the plain path


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

