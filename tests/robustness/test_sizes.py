"""Robustness: sizes and values that cannot work are refused up front, by one line that names
the key, instead of crashing later or eating the machine.

- sizes that cannot fit: `nlq train` estimates the run's peak memory from the config
  (nlq/run/memory.py) before anything is built or written, and refuses with the key that
  makes it large; `nlq params` counts any size at once without building it;
- integers: every integer key has a range, checked when the config loads (seeds >= 0, sizes
  below 2^31, everything within 64 bits);
- a masked LM that would mask fewer than one token per micro-batch is refused, and a
  micro-batch that masks none adds a loss of 0, not NaN;
- TOML nested thousands deep, or an integer of thousands of digits: one line naming the file;
- an over-long path is reported as what it is, naming its key, and every echoed value is cut;
- `preset = NAME` names a shipped preset, never a file.

Each bad input runs as its own `nlq` process forked from the zygote (conftest.py).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import time
import typing
from pathlib import Path

import helpers
import pytest
import torch
from helpers import assert_user_error, metrics, ok, tiny_config, write_config

from nlq.config import SECTIONS, ModelConfig, load_config, parse_sets
from nlq.errors import NlqError, cut_long, os_error_text, short
from nlq.model import Transformer
from nlq.model.params import count_params
from nlq.run import memory

one_thread = helpers.one_thread  # autouse: this process compares tensors on one thread

CPU = torch.device("cpu")
BIG = 2**31 - 1  # the largest size a config accepts


@pytest.fixture(scope="module")
def okc(tmp_path_factory, data) -> Path:
    tmp = tmp_path_factory.mktemp("sizes")
    return write_config(tmp / "ok.toml", tiny_config(data, **{"train.max_steps": 2}))


def timed(zygote, *args, timeout: float = 120, **env):
    t0 = time.monotonic()
    p = zygote.start(*args, **env).wait(timeout)  # past timeout: killed, and the test fails
    return p, time.monotonic() - t0


def one_error_line(p) -> str:
    """Exit 2, one `nlq: error:` line on stderr and nothing else, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    last = assert_user_error(p)
    assert p.stderr.strip().splitlines() == [last], p.stderr
    return last


# -- sizes that cannot fit ------------------------------------------------------------------

# key -> the --set values that make it the one too large. Each estimate is terabytes, far
# beyond any machine these tests run on (the test skips where it would fit: then the run
# would really start).
TOO_LARGE = {
    "model.d_model": ["model.d_model=1000000"],
    "model.n_layer": ["model.n_layer=100000000"],
    # attention dropout on CPU keeps (B, nh, T, T) tensors: the heads' scores dominate
    "model.n_head": ["model.dropout=0.1", "model.block_size=1024", "model.d_model=65536",
                     "model.n_head=65536"],
    "model.vocab_size": ["model.vocab_size=2000000000"],
    "model.block_size": [f"model.block_size={2**30}"],
    "model.mlp_hidden": [f"model.mlp_hidden={BIG}"],
    "model.query_args.rank": ["model.query=nonlinear", f"model.query_args.rank={BIG}"],
    "train.micro_batch": [f"train.micro_batch={BIG}"],
    "train.eval_batches": [f"train.eval_batches={BIG}"],
}


@pytest.mark.parametrize("key", list(TOO_LARGE))
def test_size_that_cannot_fit_is_refused_before_anything_is_built(key, okc, zygote, tmp_path):
    """Exit 2 within seconds, one line naming the key, the estimate and the memory free; no
    run dir. The estimate is recomputed here: it names the same key in process."""
    sets = TOO_LARGE[key]
    cfg = load_config(okc, parse_sets(sets))
    est = memory.estimate(cfg, CPU)
    if est.total <= (memory.available(CPU) or 0):  # pragma: no cover - a huge machine
        pytest.skip(f"{key}: {memory.gib(est.total)} would fit here")
    assert memory.dominant_key(cfg, CPU) == key
    out = tmp_path / "run"
    args = ["train", okc, "--out", out, "--no-progress"]
    for s in sets:
        args += ["--set", s]
    p, wall = timed(zygote, *args, timeout=60)
    last = one_error_line(p)
    assert f"{key} = " in last and "does not fit" in last and "free" in last, last
    assert f"lower {key}" in last, last
    assert wall < 30, f"{wall:.1f}s: refused only after building something"
    assert not out.exists()


def test_reported_sizes_are_refused(okc, zygote, tmp_path):
    """The sizes of the report: too large for memory, or beyond a size's range (2^31 - 1)."""
    for s, key in [("model.vocab_size=2000000000", "model.vocab_size"),
                   ("model.mlp_hidden=1000000000000", "model.mlp_hidden")]:
        p, wall = timed(zygote, "train", okc, "--out", tmp_path / "run", "--no-progress",
                        "--set", s, timeout=60)
        assert key in one_error_line(p) and wall < 30
        assert not (tmp_path / "run").exists()


def test_reproduce_refuses_a_size_before_writing_anything(zygote, tmp_path):
    out = tmp_path / "exp"
    p, wall = timed(zygote, "reproduce", "--preset", "tiny", "--seeds", "2", "--arms",
                    "linear,nonlinear", "--out", out, "--set", "model.n_layer=100000000",
                    timeout=60)
    assert "model.n_layer" in one_error_line(p) and wall < 30
    assert not out.exists()


def test_nlq_params_counts_a_huge_model_at_once(zygote):
    """`nlq params --set model.n_layer=100000` (300 s before: it built every layer on the
    meta device) answers within seconds, and its count is what blocks add up to: the count at
    n_layer 1 plus 99,999 times one block (the difference of the counts at 2 and 1)."""
    p, wall = timed(zygote, "params", "--preset", "tiny", "--set", "model.n_layer=100000",
                    "--json", timeout=120)
    ok(p)
    assert wall < 20, f"{wall:.1f}s"
    arms = {a["name"]: a for a in json.loads(p.stdout)["arms"]}
    tiny = load_config("tiny").model
    for q in ("linear", "nonlinear", "identity"):
        one = count_params(dataclasses.replace(tiny, query=q, n_layer=1))
        two = count_params(dataclasses.replace(tiny, query=q, n_layer=2))
        want = one[0] + 99_999 * (two[0] - one[0])
        assert arms[q]["total"] == want, q


def test_count_params_equals_the_built_model():
    """The closed form in n_layer against a real model, for each query and a deep one."""
    for q in ("linear", "nonlinear", "identity", "residual"):
        cfg = ModelConfig(vocab_size=50, block_size=8, n_layer=5, n_head=2, d_model=16,
                          mlp_hidden=24, query=q, tie_embeddings=q != "residual")
        m = Transformer(cfg, seed=0)
        assert count_params(cfg) == (m.num_params(), m.num_params(non_embedding=True)), q


def test_loading_a_model_too_large_is_refused_before_reading(zygote, tmp_path):
    """`nlq sample` / `nlq eval` of a saved model whose config.json was edited to a size
    this machine cannot hold: one line naming the folder, before any weight is read (there
    is no weight file at all here)."""
    m = ModelConfig(vocab_size=2_000_000_000, block_size=64, n_layer=2, n_head=8, d_model=1024)
    if memory.estimate_inference(m) <= (memory.available(CPU) or 0):  # pragma: no cover
        pytest.skip("would fit here")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps(dataclasses.asdict(m)))
    for cmd in ("sample", "eval"):
        last = one_error_line(zygote.run(cmd, saved))
        assert str(saved) in last and "vocab_size 2000000000" in last and "free" in last, last


# The runs whose peak memory is compared with the estimate: the tiny config (the baseline),
# one run whose memory is activations and one whose memory is weights and AdamW state.
RUNS = {
    "base": {},
    "activations": {"train.micro_batch": 256, "model.block_size": 64, "model.n_layer": 4,
                    "model.d_model": 64},
    "weights": {"model.n_layer": 4, "model.d_model": 512, "model.n_head": 8,
                "model.mlp_hidden": 2048},
}


def test_estimate_is_within_2x_of_the_measured_peak(data, zygote, tmp_path):
    """What is compared, honestly: each run's peak RSS is its own `peak_mem_mb` metric
    (getrusage ru_maxrss of the `nlq train` process, a child of the zygote). That includes the
    interpreter, torch and the zygote's heap, hundreds of MB that the estimate leaves out and
    that dwarf the tiny baseline; so the estimate's increment from the baseline run to each
    larger run is compared with the measured increment between the same two runs (each
    ~0.2-0.5 GB), and must be within a factor 2 of it."""
    peak, est = {}, {}
    for name, sets in RUNS.items():
        cfg = tiny_config(data, **{"train.max_steps": 2, "train.eval_interval": 2,
                                   "train.ckpt_interval": 2, **sets})
        path = write_config(tmp_path / f"{name}.toml", cfg)
        ok(zygote.run("train", path, "--out", tmp_path / name, "--no-progress"))
        peak[name] = max(r["peak_mem_mb"] for r in metrics(tmp_path / name, "train")) * 2**20
        est[name] = memory.estimate(cfg, CPU).total
    for name in ("activations", "weights"):
        measured, estimated = peak[name] - peak["base"], est[name] - est["base"]
        print(f"{name}: measured +{measured / 2**20:.0f} MiB, estimated "
              f"+{estimated / 2**20:.0f} MiB")
        assert measured > 100 * 2**20, "too small to compare"
        assert 0.5 <= estimated / measured <= 2.0, (name, measured, estimated)


def test_memory_check_counts_processes_and_can_be_skipped(okc, monkeypatch):
    """procs processes sharing the memory need procs times the estimate; NLQ_MEMORY_CHECK=0
    turns the check off."""
    cfg = load_config(okc)
    need = memory.estimate(cfg, CPU).total
    monkeypatch.setattr(memory, "available", lambda device: int(need * 1.5))
    memory.check_fits(cfg, CPU)
    with pytest.raises(NlqError, match=r"2 processes x .* free"):
        memory.check_fits(cfg, CPU, procs=2)
    monkeypatch.setenv("NLQ_MEMORY_CHECK", "0")
    memory.check_fits(cfg, CPU, procs=2)


def test_available_memory_is_known_here():
    free = memory.available(CPU)
    assert free is not None and 0 < free < 2**50


# -- integers ---------------------------------------------------------------------------------

RANGE_ERRORS = [
    ("train.seed=-1", "train.seed"),
    ("data.seed=-5", "data.seed"),
    (f"train.seed={2**63}", "train.seed"),
    ("model.vocab_size=99999999999999999999", "model.vocab_size"),
    (f"model.n_layer={2**31}", "model.n_layer"),
    ("train.max_steps=99999999999999999999", "train.max_steps"),
    ("train.warmup_steps=-1", "train.warmup_steps"),
    ("model.query_args.rank=0", "model.query_args"),
    (f"model.vocab_size={'9' * 5000}", "model.vocab_size"),  # more digits than int() takes
]


@pytest.mark.parametrize("setting,key", RANGE_ERRORS, ids=[k for _, k in RANGE_ERRORS])
def test_integer_out_of_range_is_refused_at_load(setting, key, okc, zygote, tmp_path):
    p, _ = timed(zygote, "train", okc, "--out", tmp_path / "run", "--no-progress", "--set",
                 setting)
    last = one_error_line(p)
    assert key in last and len(last) < 300, last
    assert not (tmp_path / "run").exists()


def _int_keys() -> list[str]:
    out = []
    for sec, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)
                if hints[f.name] is int or int in typing.get_args(hints[f.name])]
    return out


@pytest.mark.parametrize("key", _int_keys())
def test_every_integer_key_has_a_range(key, okc):
    """Every integer key (those added later too) refuses a value beyond 64 bits, naming it;
    a size refuses 2^31 already."""
    for value in (2**63, -(2**63) - 1):
        with pytest.raises(NlqError, match=key.replace(".", r"\.")):
            load_config(okc, {key: value})
    from nlq.config.validate import INT_RANGES, SIZE

    if INT_RANGES.get(key) == SIZE:
        with pytest.raises(NlqError, match=key.replace(".", r"\.")):
            load_config(okc, {key: 2**31})


def test_extreme_seeds_that_load_also_train(data, zygote, tmp_path):
    """The range's ends are values the consumers take: seeds 2^63 - 1 and 0 train."""
    cfg = tiny_config(data, **{"train.max_steps": 2, "train.seed": 2**63 - 1, "data.seed": 0,
                               "model.dropout": 0.1})
    ok(zygote.run("train", write_config(tmp_path / "c.toml", cfg), "--out", tmp_path / "run",
                  "--no-progress"))


def test_toml_integer_of_thousands_of_digits_names_file_and_line(zygote, tmp_path):
    f = tmp_path / "digits.toml"
    f.write_text(f"[model]\nn_layer = 2\nvocab_size = {'9' * 5000}\n")
    last = one_error_line(zygote.run("train", f))
    assert str(f) in last and "line 3" in last and "4300 digits" in last, last


# -- masked LM with (almost) nothing masked -----------------------------------------------


def test_mlm_prob_masking_under_one_token_per_micro_batch_is_refused(okc, zygote, tmp_path):
    """0.01 x 16 tokens x 4 sequences = 0.64 masked tokens per micro-batch: refused at load,
    naming train.mlm_prob (it ran into a NaN loss blamed on the lr before)."""
    p, _ = timed(zygote, "train", okc, "--out", tmp_path / "run", "--no-progress", "--set",
                 "model.arch=encoder", "--set", "train.mlm_prob=0.01")
    last = one_error_line(p)
    assert "train.mlm_prob" in last and "0.64" in last, last
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("return_logits", [False, True], ids=["chunked", "logits"])
def test_loss_of_a_batch_without_targets_is_zero(return_logits):
    """A micro-batch whose targets are all -1 (nothing masked): loss 0 and zero gradients on
    both loss paths, not F.cross_entropy's NaN."""
    cfg = ModelConfig(arch="encoder", vocab_size=50, block_size=8, n_layer=1, n_head=2,
                      d_model=16)
    m = Transformer(cfg, seed=0)
    x = torch.randint(0, 50, (3, 8))
    _, loss = m(x, torch.full((3, 8), -1), return_logits=return_logits)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in m.parameters())


def test_encoder_trains_through_micro_batches_that_mask_nothing(data, zygote, tmp_path):
    """mlm_prob 0.016 (1.02 masked tokens per micro-batch on average): some micro-batches of
    the run mask nothing (checked on its own batches); it finishes with finite losses."""
    from nlq.run.batches import Batches
    from nlq.run.world import World

    cfg = tiny_config(data, **{"model.arch": "encoder", "train.mlm_prob": 0.016,
                               "train.max_steps": 6, "train.test_eval": False})
    batches = Batches(cfg, World(), CPU)
    counts = [int((batches.train(s, i)[1] >= 0).sum()) for s in range(6) for i in range(2)]
    assert 0 in counts, counts
    run = tmp_path / "run"
    ok(zygote.run("train", write_config(tmp_path / "c.toml", cfg), "--out", run,
                  "--no-progress"))
    assert all(math.isfinite(r["loss"]) for r in metrics(run, "train"))


# -- deep nesting --------------------------------------------------------------------------

NESTED = {
    "arrays": "a = " + "[" * 3000 + "]" * 3000 + "\n",
    "inline tables": "a = " + "{x = " * 3000 + "}" * 3000 + "\n",
    "a dotted table header": "[" + ".".join(["a"] * 3000) + "]\n",
    "40 levels, parseable": "[model]\nquery_args = " + "[" * 40 + "]" * 40 + "\n",
}


@pytest.mark.parametrize("what", list(NESTED))
def test_deeply_nested_toml_names_the_file(what, zygote, tmp_path):
    f = tmp_path / "deep.toml"
    f.write_text(NESTED[what])
    last = one_error_line(zygote.run("train", f, "--out", tmp_path / "run"))
    assert last.startswith(f"nlq: error: config file {f}: nested too deeply"), last
    assert not (tmp_path / "run").exists()


def test_deeply_nested_set_value_names_the_key(okc, zygote):
    last = one_error_line(zygote.run("config", okc, "--set",
                                     "model.query=" + "[" * 3000 + "]" * 3000))
    assert "--set 'model.query'" in last and "nested too deeply" in last, last


# -- long paths and long values ---------------------------------------------------------------


@pytest.mark.parametrize("what", ["5000 chars", "a 300-byte name", "a NUL"])
def test_bad_data_dir_names_the_key(what, okc, zygote, tmp_path):
    """Reported as data.dir's fault when the config loads (it was an I/O error of the run dir
    with advice to free space, echoing the whole path), the value cut."""
    value = {"5000 chars": "/tmp/" + "a" * 5000, "a 300-byte name": f"/tmp/{'b' * 300}/data",
             "a NUL": "data\\u0000dir"}[what]
    p, _ = timed(zygote, "train", okc, "--out", tmp_path / "run", "--no-progress", "--set",
                 f'data.dir="{value}"')
    last = one_error_line(p)
    assert last.startswith("nlq: error: config key 'data.dir'"), last
    assert ("NUL" if what == "a NUL" else "path too long") in last, last
    assert "free space" not in last and len(last) < 300, last
    assert not (tmp_path / "run").exists()


def test_long_paths_elsewhere_are_cut(okc, zygote, tmp_path):
    """An --out or a config path of 5000 characters: one line, the path cut, no advice to
    free space."""
    long = tmp_path / ("c" * 5000)
    for args in (["train", okc, "--out", long, "--no-progress"], ["train", f"{long}.toml"],
                 ["train", long]):
        last = one_error_line(zygote.run(*args))
        assert len(last) < 700 and "free space" not in last, last


def test_short_and_cut_long():
    assert short("abc") == "'abc'"
    s = short("x" * 5000)
    assert len(s) < 100 and "5000 chars" in s
    assert short(10**400) == "an integer of 1329 bits"
    nested: list = []
    for _ in range(3000):
        nested = [nested]
    assert len(short(nested)) <= 80
    text = cut_long("path /" + "d" * 1000 + "/f.txt is bad")
    assert text.startswith("path /ddd") and text.endswith("/f.txt is bad") and len(text) < 300
    text = cut_long("got [" + "1, " * 5000 + "2]")  # a value with blanks: the line is cut
    assert text.startswith("got [1, ") and text.endswith("2]") and len(text) < 1000


def test_os_error_advice_fits_the_error():
    long = "/tmp/" + "a" * 5000
    text = os_error_text(OSError(errno.ENAMETOOLONG, "File name too long", long))
    assert "path too long" in text and "free space" not in text and len(text) < 250
    assert "free space" in os_error_text(OSError(errno.ENOSPC, "No space left on device", "f"))


# -- presets --------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["../presets/tiny", "ABS", "tiny.toml", "", "presets/../tiny"])
def test_preset_key_names_a_shipped_preset_never_a_file(base, okc, zygote, tmp_path):
    """`preset = "../x"` or an absolute path loaded any .toml on the disk as the base."""
    if base == "ABS":
        base = str(okc.with_suffix(""))  # okc without .toml: a file that exists
    f = tmp_path / "child.toml"
    f.write_text(f'preset = "{base}"\n[train]\nmax_steps = 2\n')
    last = one_error_line(zygote.run("config", f))
    assert "'preset'" in last and str(f) in last and "gpt3-small, small, tiny" in last, last


def test_preset_by_name_still_works(tmp_path):
    f = tmp_path / "child.toml"
    f.write_text('preset = "tiny"\n[model]\nn_layer = 2\n')
    assert load_config(f) == load_config("tiny").replace(**{"model.n_layer": 2})


def test_path_as_preset_name_on_the_command_line(zygote):
    last = one_error_line(zygote.run("train", "../presets/tiny"))
    assert "unknown preset '../presets/tiny'" in last, last
