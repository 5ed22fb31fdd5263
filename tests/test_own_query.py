"""Your own query variant: plain-argument query modules, register_query, and `nlq --import`
carrying a user variant into `nlq train` and into the runs a command starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT, assert_user_error, make_data, metrics, nlq, ok, tiny_config

from nlq.config import ModelConfig, load_config
from nlq.errors import NlqError
from nlq.model.query import QUERIES, NonlinearQuery, register_query

EXAMPLE = ROOT / "examples" / "own_query.py"


def test_plain_arguments_build_the_paper_query():
    q = NonlinearQuery(d_model=64, rank=32)
    assert q.w1.weight.shape == (32, 64) and q.w2.weight.shape == (64, 32)
    cfg = ModelConfig(d_model=64, n_head=4, nl_rank=32, nl_half="explicit")
    from_cfg = NonlinearQuery(cfg)
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
    assert_user_error(nlq("--import", "no_such_module_xyz", "params"), "no_such_module_xyz")
    assert_user_error(nlq("--import", tmp_path / "none.py", "params"), "none.py")


def test_the_plain_pytorch_example_runs():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "nonlinear_in_your_model.py")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("loss after 20 steps:")
