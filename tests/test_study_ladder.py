"""A ladder's keys are checked when it is read: each bad value is one error naming its key,
never a plan of negative runs or a failure hours into a study."""

from __future__ import annotations

import pytest
from helpers import assert_user_error, nlq

from nlq.errors import NlqError
from nlq.experiments.ladder import load_ladder
from nlq.experiments.study import rung_record

GOOD_TOP = {"experiment": '"paper"', "arms": '["linear", "nonlinear"]'}
GOOD_RUNG = {"preset": '"tiny"', "lrs": "[1e-3, 2e-3, 4e-3]", "sweep_seeds": "4", "seeds": "8",
             "device": '"cpu"', "set": '{ "train.max_steps" = 10 }', "description": '"a rung"'}


def write_ladder(path, top=None, rung=None):
    top, rung = {**GOOD_TOP, **(top or {})}, {**GOOD_RUNG, **(rung or {})}
    lines = [f"{k} = {v}" for k, v in top.items()] + ["[rungs.A]"]
    lines += [f"{k} = {v}" for k, v in rung.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_good_ladder_and_the_shipped_one_load(tmp_path):
    lad = load_ladder(write_ladder(tmp_path / "l.toml"))
    r = lad.rungs["A"]
    assert (r.seeds, r.sweep_seeds, r.lrs, r.sets) == (8, 4, [1e-3, 2e-3, 4e-3],
                                                       {"train.max_steps": 10})
    # x sqrt(2) grids are grids too
    sqrt2 = load_ladder(write_ladder(tmp_path / "s.toml",
                                     rung={"lrs": "[1e-2, 1.414e-2, 2e-2, 2.828e-2]"}))
    assert len(sqrt2.rungs["A"].lrs) == 4
    assert load_ladder().rungs  # nlq/experiments/ladder.toml
    # stacked seeds are part of a rung's recipe; lone runs keep the record rungs had before
    assert "stack" not in rung_record(lad, r)
    st = load_ladder(write_ladder(tmp_path / "k.toml", rung={"stack": "4"}))
    assert rung_record(st, st.rungs["A"])["stack"] == 4


@pytest.mark.parametrize("top, rung, match", [
    # counts: integers >= 2
    ({}, {"seeds": "-3"}, r"rungs\.A\.seeds must be an integer >= 2, got -3"),
    ({}, {"seeds": "8.0"}, r"rungs\.A\.seeds must be an integer >= 2, got 8\.0"),
    ({}, {"seeds": "true"}, r"rungs\.A\.seeds must be an integer >= 2, got True"),
    ({}, {"sweep_seeds": "1"}, r"rungs\.A\.sweep_seeds must be an integer >= 2, got 1"),
    ({}, {"stack": "0"}, r"rungs\.A\.stack must be an integer >= 1 \(seeds .*, got 0"),
    # lrs: positive, finite, a grid of one constant step
    ({}, {"lrs": "[1e-3, -2e-3, 4e-3]"}, r"rungs\.A\.lrs: -0\.002 is not a positive finite"),
    ({}, {"lrs": "[1e-3, nan, 4e-3]"}, r"rungs\.A\.lrs: nan is not a positive finite"),
    ({}, {"lrs": '[1e-3, "2e-3", 4e-3]'}, r"rungs\.A\.lrs: '2e-3' is not a positive finite"),
    ({}, {"lrs": "[1e-3, 2e-3]"}, r"rungs\.A\.lrs needs at least 3 values"),
    ({}, {"lrs": "[1e-3, 2e-3, 5e-3]"}, r"rungs\.A\.lrs must rise in one constant step"),
    ({}, {"lrs": "1e-3"}, r"rungs\.A\.lrs must be a list"),
    # device, preset, set, description
    ({}, {"device": '"tpu"'}, r"rungs\.A\.device must be cpu or cuda, got 'tpu'"),
    ({}, {"preset": '"huge"'}, r"rungs\.A\.preset: unknown preset 'huge'"),
    ({}, {"set": '{ "model.nope" = 1 }'}, r"rungs\.A\.set: .*model\.nope"),
    ({}, {"set": "3"}, r"rungs\.A\.set must be a table"),
    ({}, {"description": "3"}, r"rungs\.A\.description must be a string"),
    # tokens_per_param: positive, and not beside the steps it sets
    ({}, {"tokens_per_param": "0", "set": "{}"}, (r"rungs\.A\.tokens_per_param must be a "
     r"positive number, got 0")),
    ({}, {"tokens_per_param": '"20"', "set": "{}"}, r"tokens_per_param must be a positive"),
    ({}, {"tokens_per_param": "1e-9", "set": "{}"}, r"tokens_per_param = 1e-09 gives 0 step"),
    ({}, {"tokens_per_param": "20"}, (r"rungs\.A: tokens_per_param sets train\.max_steps; "
     r"give one or the other")),
    # the ladder's own keys
    ({"arms": '["linear", "quadratic"]'}, {}, r"arms: unknown arm 'quadratic'"),
    ({"arms": '"linear"'}, {}, r"arms must be a list of arm names"),
    ({"experiment": '"nope"'}, {}, r"experiment: unknown experiment 'nope'"),
])
def test_each_bad_key_is_one_error_naming_it(tmp_path, top, rung, match):
    with pytest.raises(NlqError, match=match):
        load_ladder(write_ladder(tmp_path / "bad.toml", top, rung))


def test_a_rung_that_is_not_a_table_is_named(tmp_path):
    (tmp_path / "bad.toml").write_text('experiment = "paper"\n[rungs]\nA = 3\n')
    with pytest.raises(NlqError, match=r"rungs\.A must be a table"):
        load_ladder(tmp_path / "bad.toml")


def test_study_refuses_a_bad_ladder_before_writing(tmp_path):
    bad = write_ladder(tmp_path / "bad.toml", rung={"seeds": "-3"})
    p = nlq("study", "--ladder", bad, "--out", tmp_path / "o", "--dry-run")
    assert p.returncode == 2
    assert_user_error(p, "rungs.A.seeds", "-3")
    assert not (tmp_path / "o").exists()


def test_tokens_per_param_sets_the_steps_and_the_warmup(tmp_path):
    """Two model sizes at one tokens_per_param train on the same tokens per non-embedding
    parameter; the warmup keeps the preset's proportion; the shipped ladder's rungs hold the
    ratios its comments give."""
    from nlq.config import load_config
    from nlq.model.params import count_params

    wide = '{ "model.d_model" = 128, "model.n_head" = 4, "model.mlp_hidden" = 512 }'
    for sets in ("{}", wide):
        lad = load_ladder(write_ladder(tmp_path / "t.toml", rung={
            "preset": '"small"', "tokens_per_param": "20", "set": sets}))
        r = lad.rungs["A"]
        cfg = load_config("small", r.sets)
        n = count_params(cfg.model)[1]
        per_step = cfg.train.micro_batch * cfg.model.block_size
        assert r.sets["train.max_steps"] == round(20 * n / per_step)
        assert abs(cfg.train.max_steps * per_step / n - 20) < per_step / n
        assert r.sets["train.warmup_steps"] == round(r.sets["train.max_steps"] * 500 / 2000)
    shipped = load_ladder().rungs
    assert shipped["S0"].sets["train.max_steps"] == 2000  # the README's main command
    assert shipped["S1"].sets["train.max_steps"] == 2000
    assert shipped["S0-short"].tokens_per_param == shipped["S1"].tokens_per_param == \
        shipped["S2"].tokens_per_param
