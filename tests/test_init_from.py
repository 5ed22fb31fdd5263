"""train.init_from: a run that starts from another model's weights. Same architecture: the
step-0 eval equals the source's final eval. A linear source into a nonlinear model: every
shared tensor is the source's, f keeps its fresh init, q.proj is dropped; resuming never
reads the source again. A Hugging Face GPT-2 folder: the same logits as transformers. A
missing path or another architecture: one `nlq: error:` line and no run dir."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import subprocess

import helpers
import pytest
import torch
from helpers import (
    VOCAB,
    assert_same_final,
    assert_user_error,
    final_ckpt,
    load_ckpt,
    metrics,
    nlq_resume,
    nlq_train,
    ok,
    reference_run,
    shared_data,
    tiny_config,
    write_config,
)

from nlq.cli import main as nlq_main
from nlq.model.transformer import Transformer
from nlq.train import init_from

one_thread = helpers.one_thread  # autouse: tiny models run ~10x faster on one thread


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return shared_data(tmp_path_factory)


@pytest.fixture(scope="module")
def source(tmp_path_factory, data):
    """A finished linear run (6 steps, checkpoints at 3 and 6)."""
    return reference_run(tmp_path_factory, tiny_config(data))


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_same_architecture_starts_at_the_source_eval_loss(source, data, tmp_path):
    cfg = tiny_config(data, **{"train.init_from": str(source)})
    p = ok(nlq_train(write_config(tmp_path / "c.toml", cfg), tmp_path / "run"))
    # step 0's eval runs on the source's final weights: the same val windows, the same loss
    assert metrics(tmp_path / "run", "eval")[0]["val_loss"] == summary(source)["val_loss"]
    weights = final_ckpt(source) / "model.safetensors"
    meta = metrics(tmp_path / "run", "meta")[0]["init_from"]
    assert meta["path"] == str(source.resolve()) and meta["weights"] == str(weights.resolve())
    assert meta["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (meta["loaded"], meta["fresh"], meta["dropped"]) == (len(load_ckpt(source)[0]), [], [])
    assert f"{meta['loaded']} tensors loaded, 0 kept their fresh init, 0 dropped" in p.stderr


def test_linear_into_nonlinear_keeps_every_shared_tensor(source, data, capsys):
    cfg = tiny_config(data, **{"model.query": "nonlinear", "train.init_from": str(source)})
    init = init_from.read(cfg)
    model = Transformer(cfg.model, seed=cfg.train.seed)  # as the training loop builds it
    init_from.apply(init, model, verbose=True)
    fresh = Transformer(cfg.model, seed=cfg.train.seed).weights()
    src = load_ckpt(source)[0]
    for name, w in model.weights().items():
        assert torch.equal(w, src[name] if name in src else fresh[name]), name
    assert init.dropped == ["blocks.0.attn.q.proj.weight"]
    assert init.fresh == [f"blocks.0.attn.q.{n}.weight" for n in ("in_norm", "w1", "w2", "out_norm")]
    assert len(init.loaded) == len(src) - 1
    line = capsys.readouterr().err.strip()
    assert line.endswith(f"{len(src) - 1} tensors loaded, {len(init.fresh)} kept their fresh "
                         f"init (blocks.0.attn.q.in_norm.weight, blocks.0.attn.q.w1.weight, "
                         f"blocks.0.attn.q.w2.weight, ... 1 more), 1 dropped "
                         f"(blocks.0.attn.q.proj.weight)"), line


def test_a_resumed_run_never_reads_init_from_again(source, data, tmp_path):
    src = shutil.copytree(source, tmp_path / "src")
    cfg = tiny_config(data, **{"model.query": "nonlinear", "train.init_from": str(src),
                               "train.ckpt_interval": 2, "train.keep_checkpoints": 10})
    run = tmp_path / "run"
    p = ok(nlq_train(write_config(tmp_path / "c.toml", cfg), run))
    assert "kept their fresh init" in p.stderr
    # as if killed after its step-4 checkpoint, with the source gone
    stopped = shutil.copytree(run, tmp_path / "stopped")
    (stopped / "summary.json").unlink()
    shutil.rmtree(stopped / "ckpt" / "step_000006")
    (stopped / "ckpt" / "latest").write_text("step_000004\n")
    shutil.rmtree(src)
    p = ok(nlq_resume(stopped))
    assert "init_from" not in p.stderr
    assert_same_final(run, stopped)


def cli(*args) -> subprocess.CompletedProcess:
    """`nlq ARGS` through nlq.cli.main in this process (the CLI's own error path)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = nlq_main([str(a) for a in args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("case", ["missing", "another d_model", "no model"])
def test_a_bad_init_from_is_one_error_line_and_no_run_dir(source, data, tmp_path, case):
    plain = tmp_path / "plain"
    plain.mkdir()
    path, over, names = {
        "missing": (tmp_path / "nothing", {}, ("nothing", "does not exist")),
        "another d_model": (source, {"model.d_model": 64}, ("wte.weight", "(320, 32)",
                                                            "(320, 64)")),
        "no model": (plain, {}, ("plain", "not a run dir")),
    }[case]
    cfg = tiny_config(data, **{"train.init_from": str(path), **over})
    p = cli("train", write_config(tmp_path / "c.toml", cfg), "--out", tmp_path / "run",
            "--no-progress")
    assert p.returncode == 2
    assert_user_error(p, "train.init_from", *names)
    assert not (tmp_path / "run").exists()


# -- a Hugging Face GPT-2 folder -------------------------------------------------------------

C, L, NH, BLOCK = 32, 2, 2, 16


def gpt2_folder(path, safetensors: bool = True, act: str = "gelu"):
    """A tiny random GPT2LMHeadModel saved with save_pretrained, with O(1) weights (LN gains,
    biases) so a wrong mapping shows in the logits."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=BLOCK, n_embd=C, n_layer=L, n_head=NH, n_inner=2 * C,
        activation_function=act, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape)
            p.copy_(1.0 + 0.2 * noise if ".ln_" in name or "ln_f" in name else
                    0.1 * noise if p.ndim == 1 else noise / p.shape[0] ** 0.5)
    hf.save_pretrained(path, safe_serialization=safetensors)
    return hf


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_a_gpt2_folder_gives_gpt2s_logits(data, tmp_path, safetensors):
    hf = gpt2_folder(tmp_path / "gpt2", safetensors)
    cfg = tiny_config(data, **{"model.bias": True, "model.n_layer": L, "model.mlp_hidden": 2 * C,
                               "train.init_from": str(tmp_path / "gpt2")})
    init = init_from.read(cfg)
    assert (init.fresh, init.dropped, init.notes) == ([], [], [])
    model = Transformer(cfg.model, seed=cfg.train.seed).eval()
    init_from.apply(init, model, verbose=False)
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_gpt2s_own_activation_is_named(data, tmp_path):
    gpt2_folder(tmp_path / "gpt2", act="gelu_new")  # what GPT-2's released checkpoints use
    cfg = tiny_config(data, **{"model.bias": True, "model.n_layer": L, "model.mlp_hidden": 2 * C,
                               "train.init_from": str(tmp_path / "gpt2")})
    assert "'gelu_new'" in init_from.read(cfg).notes[0]


def test_a_gpt2_config_that_changes_the_function_is_named(data, tmp_path):
    """Weights that load into another function are noted: a layer_norm_epsilon other than
    model.norm_eps, and attention logits left unscaled."""
    import json

    gpt2_folder(tmp_path / "gpt2")
    conf = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    conf.update(layer_norm_epsilon=1e-2, scale_attn_weights=False)
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(conf))
    cfg = tiny_config(data, **{"model.bias": True, "model.n_layer": L, "model.mlp_hidden": 2 * C,
                               "train.init_from": str(tmp_path / "gpt2")})
    notes = init_from.read(cfg).notes
    assert any("scale_attn_weights = false" in n for n in notes)
    assert any("layer_norm_epsilon is 0.01" in n and "model.norm_eps = 0.01" in n for n in notes)
    fixed = cfg.replace(**{"model.norm_eps": 1e-2})
    assert not any("layer_norm_epsilon" in n for n in init_from.read(fixed).notes)
