"""Sampling: Transformer.generate against plain references, and `nlq sample` end to end."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from helpers import assert_user_error, make_bpe_data, make_data, nlq, ok, tiny_config
from test_model_hf_parity import V, hf_model, ours_from_hf

from nlq.config import ModelConfig
from nlq.data.tokenizers import HFBpe, train_bpe
from nlq.errors import NlqError
from nlq.model.generate import filter_logits
from nlq.model.transformer import Transformer
from nlq.train.loop import train


def small_model(**kw) -> Transformer:
    cfg = ModelConfig(vocab_size=61, block_size=12, n_layer=2, n_head=2, d_model=32,
                      mlp_hidden=64, query=kw.pop("query", "nonlinear"), **kw)
    m = Transformer(cfg, seed=5).eval()
    with torch.no_grad():  # larger weights than the init: peaked, input-dependent logits
        for p in m.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    return m


def argmax_reference(model, idx, n):
    """Greedy decoding written out: the whole (cropped) context through the model each step."""
    seq = idx.tolist()
    for _ in range(n):
        for row in seq:
            ctx = torch.tensor([row[-model.cfg.block_size:]])
            with torch.no_grad():
                logits, _ = model(ctx)
            row.append(int(logits[0, -1].argmax()))
    return torch.tensor(seq)


def test_greedy_matches_step_by_step_argmax_past_the_block_size():
    m = small_model()
    idx = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(0))
    got = m.generate(idx, 20, temperature=0)  # 25 > block_size 12: the context is cropped
    assert torch.equal(got, argmax_reference(m, idx, 20))
    assert len(set(got[0, 5:].tolist())) > 1  # not a constant stream: the test can fail


def test_greedy_matches_transformers_gpt2_generate():
    hf = hf_model("eager")
    ours = ours_from_hf(hf)
    idx = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(4))
    want = hf.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones_like(idx))
    assert torch.equal(ours.generate(idx, 12, temperature=0), want)


def test_sampling_is_fixed_by_its_seed_and_leaves_the_global_generator_alone():
    m = small_model()
    idx = torch.zeros(4, 1, dtype=torch.long)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = m.generate(idx, 15, temperature=1.0, seed=7)
    assert torch.equal(torch.rand(3), before)  # generate drew nothing from the global one
    assert torch.equal(a, m.generate(idx, 15, temperature=1.0, seed=7))
    assert not torch.equal(a, m.generate(idx, 15, temperature=1.0, seed=8))
    # top-k 1 and a tiny top-p keep only the likeliest token: greedy, whatever the seed
    greedy = m.generate(idx, 15, temperature=0)
    assert torch.equal(m.generate(idx, 15, top_k=1, seed=1), greedy)
    assert torch.equal(m.generate(idx, 15, top_p=1e-6, seed=2), greedy)


def test_filter_logits_keeps_the_smallest_nucleus():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g) * 2
    for p in (0.1, 0.5, 0.9, 0.999):
        kept = filter_logits(logits, None, p) > float("-inf")
        probs = torch.softmax(logits, -1)
        for row in range(5):
            order = probs[row].argsort(descending=True).tolist()
            acc, want = 0.0, set()
            for t in order:  # brute force: add the likeliest until p is reached
                want.add(t)
                acc += float(probs[row, t])
                if acc >= p:
                    break
            assert set(kept[row].nonzero().flatten().tolist()) == want
    top3 = filter_logits(logits, 3, None) > float("-inf")
    assert (top3.sum(-1) == 3).all()


def test_stop_token_ends_rows_and_pads_them():
    m = small_model()
    idx = torch.randint(0, 61, (3, 2), generator=torch.Generator().manual_seed(1))
    free = m.generate(idx, 30, temperature=0)
    stop = int(free[0, 2 + 3])  # row 0's 4th new token
    got = m.generate(idx, 30, temperature=0, stop_token=stop)
    assert torch.equal(got[0, : 2 + 4], free[0, : 2 + 4])
    assert (got[0, 2 + 4:] == stop).all()
    for row in range(3):  # each row equals the free run up to its first stop, then stops
        new = free[row, 2:].tolist()
        cut = new.index(stop) + 1 if stop in new else len(new)
        assert got[row, 2 : 2 + cut].tolist() == new[:cut]


def test_bad_sampling_settings_and_encoders_are_refused():
    m = small_model()
    idx = torch.zeros(1, 1, dtype=torch.long)
    for kw, msg in (({"top_p": 0.0}, "top-p"), ({"top_p": 1.5}, "top-p"),
                    ({"top_k": 0}, "top-k"), ({"temperature": -1.0}, "temperature"),
                    ({"temperature": 0.0, "top_k": 5}, "no effect")):
        with pytest.raises(NlqError, match=msg):
            m.generate(idx, 3, **kw)
    with pytest.raises(NlqError, match="encoder"):
        small_model(arch="encoder").generate(idx, 3)


# -- nlq sample ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run on data whose meta.json names a real (tiny) trained BPE."""
    d = make_bpe_data(tmp_path_factory.mktemp("data"))
    r = tmp_path_factory.mktemp("run") / "run"
    train(tiny_config(d, **{"model.vocab_size": 300, "train.max_steps": 4}), r, progress=False)
    return r


def test_nlq_sample_is_deterministic_and_accepts_a_checkpoint_dir(run):
    args = ("sample", run, "--prompt", "the quick", "--max-new-tokens", "12", "--seed", "3",
            "--no-stop")
    a, b = ok(nlq(*args)), ok(nlq(*args))
    assert a.stdout == b.stdout and a.stdout.startswith("the quick")
    step = max((run / "ckpt").glob("step_*"))
    c = ok(nlq("sample", step, *args[2:]))
    assert c.stdout == a.stdout  # the newest checkpoint of the run, loaded either way


def test_nlq_sample_bad_input(run, tmp_path):
    p = nlq("sample", run, "--top-p", "1.5")
    assert_user_error(p, "top-p")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.toml").write_text((run / "config.toml").read_text())
    assert_user_error(nlq("sample", empty), "no checkpoint")
    big = make_data(tmp_path / "big", vocab_size=400)
    r = random.Random(0)  # 300 random words: enough pairs for 400 tokens
    words = ["".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(300)]
    train_bpe([" ".join(words)] * 3, 400, big / "tokenizer.json")
    assert HFBpe(big / "tokenizer.json").vocab_size == 400
    meta = json.loads((big / "meta.json").read_text())
    meta["tokenizer"] = "bpe:400"
    (big / "meta.json").write_text(json.dumps(meta))
    assert_user_error(nlq("sample", run, "--data", big), "tokenized otherwise")
    from nlq.infer.load import load_model  # a saved folder names no data: its vocab is checked

    load_model(run)[0].save_pretrained(tmp_path / "saved")
    assert_user_error(nlq("sample", tmp_path / "saved", "--data", big), "does not fit the model")
    assert_user_error(nlq("sample", run, "--seed", str(2**70)), "--seed must be in")
    assert_user_error(nlq("sample", tmp_path / "nowhere"), "does not exist")
    # a byte that is not UTF-8 on the command line reaches Python as a lone surrogate
    assert_user_error(nlq("sample", run, "--prompt", "ab\udcffcd"), "--prompt")


# -- nlq eval --------------------------------------------------------------------------------


def test_nlq_eval_equals_the_runs_own_test_eval(run):
    summary = json.loads((run / "summary.json").read_text())
    r = json.loads(ok(nlq("eval", run, "--json")).stdout)
    assert r["log_loss"] == pytest.approx(summary["test_loss"], rel=1e-9)
    assert r["tokens"] == summary["test_tokens"] and r["docs"] == summary["test_docs"]
    docs = json.loads((run / "test_docs.json").read_text())
    assert r["per_doc"]["nats"] == pytest.approx(docs["nats"], rel=1e-9)
    lo, hi = r["ci95"]
    assert lo < r["log_loss"] < hi
    val = json.loads(ok(nlq("eval", run, "--split", "val", "--json")).stdout)
    assert val["tokens"] > 0 and val["log_loss"] != r["log_loss"]


def test_nlq_eval_refuses_data_of_another_tokenizer(run, tmp_path):
    other = make_data(tmp_path / "other", vocab_size=300)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"] = "gpt2"
    (other / "meta.json").write_text(json.dumps(meta))
    assert_user_error(nlq("eval", run, "--data", other), "tokenized otherwise")


def test_a_checkpoint_dir_is_a_model_folder(run):
    """Every checkpoint holds config.json beside model.safetensors: from_pretrained loads it
    as the run's own weights."""
    from nlq.infer.load import load_model

    step = max((run / "ckpt").glob("step_*"))
    a = Transformer.from_pretrained(step).eval()
    b, _ = load_model(run)
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(idx)[0], b(idx)[0])


def test_nlq_convert_writes_a_gpt2_folder_with_the_runs_tokenizer(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from nlq.infer.load import load_model, load_tokenizer

    ok(nlq("convert", run, "--out", tmp_path / "g"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "g").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "g")
    ours, data = load_model(run)
    text = "the early bird catches the lazy fox"
    ids = load_tokenizer(data).encode([text])[0].tolist()
    assert hf_tok(text).input_ids == ids  # the same tokens from the exported tokenizer
    idx = torch.tensor([ids])
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)[0]).abs().max() < 1e-5
    # transformers' format: nlq's readers say so instead of failing on its config keys
    assert_user_error(nlq("eval", tmp_path / "g", "--data", data), "transformers GPT-2 folder")
    nl = Transformer(dataclasses.replace(ours.cfg, query="nonlinear"))
    nl.save_pretrained(tmp_path / "nl")
    assert_user_error(nlq("convert", tmp_path / "nl", "--out", tmp_path / "x"), "query")
    assert not (tmp_path / "x").exists()
