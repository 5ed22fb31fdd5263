"""The test split: scored once at the end of a run, document by document and chunk by chunk
of the test stream, and equal to a plain reference computation; a data dir without one is a
clear error before training."""

from __future__ import annotations

import json
import math

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import EOT, make_data, tiny_config
from safetensors.torch import load_file

from nlq.data.schedule import TokenData
from nlq.errors import NlqError
from nlq.model import Transformer
from nlq.run.scoring import doc_windows
from nlq.train.loop import train

one_thread = helpers.one_thread


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data = make_data(tmp_path_factory.mktemp("data"))
    d = tmp_path_factory.mktemp("run") / "r"
    cfg = tiny_config(data)
    train(cfg, d, progress=False)
    return cfg, data, d


def reference_token_losses(cfg, data_dir, run_dir) -> list[torch.Tensor]:
    """Each test document after an end-of-text token, scored window by window with a plain
    forward and F.cross_entropy: per document, the loss of each of its tokens."""
    sd = load_file(str(helpers.final_ckpt(run_dir) / "model.safetensors"))
    if cfg.model.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
    model = Transformer(cfg.model, seed=0)
    model.load_state_dict(sd)
    model.eval()
    out, T = [], cfg.model.block_size
    with torch.no_grad():
        for doc in TokenData.open(data_dir).test_docs():
            s = torch.tensor([EOT, *doc.tolist()])
            losses = []
            for a in range(0, len(doc), T):
                piece = s[a:a + T + 1]
                logits, _ = model(piece[None, :-1])
                losses.append(F.cross_entropy(logits[0].double(), piece[1:], reduction="none"))
            out.append(torch.cat(losses))  # (len(doc),)
    return out


def reference_doc_losses(cfg, data_dir, run_dir):
    """(nats, tokens) per document of the plain reference."""
    return [(t.sum().item(), len(t)) for t in reference_token_losses(cfg, data_dir, run_dir)]


def test_per_document_losses_match_a_plain_reference(run):
    cfg, data, d = run
    docs = json.loads((d / "test_docs.json").read_text())
    ref = reference_doc_losses(cfg, data, d)
    assert len(docs["doc"]) == len(ref) > 1
    assert docs["tokens"] == [n for _, n in ref]
    assert docs["nats"] == pytest.approx([x for x, _ in ref], rel=1e-5)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["test_loss"] == pytest.approx(sum(docs["nats"]) / sum(docs["tokens"]))
    assert summary["test_tokens"] == sum(docs["tokens"]) == len(TokenData.open(data).test)
    assert summary["test_docs"] == len(docs["doc"])
    assert summary["test_ppl"] == pytest.approx(math.exp(summary["test_loss"]))


def test_chunks_cut_the_same_stream_as_the_documents(run):
    """Chunks of block_size scored tokens: their sums are the documents' sums (the test loss
    is the same either way), and each chunk's nats are a plain reference's per-token losses
    of the stream, cut every block_size tokens."""
    cfg, data, d = run
    docs = json.loads((d / "test_docs.json").read_text())
    T = cfg.model.block_size
    assert docs["chunk_size"] == T
    n = docs["chunk_tokens"]
    assert sum(n) == sum(docs["tokens"]) and set(n[:-1]) == {T} and 0 < n[-1] <= T
    assert math.fsum(docs["chunk_nats"]) == pytest.approx(math.fsum(docs["nats"]), rel=1e-12)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["test_loss"] == sum(docs["nats"]) / sum(docs["tokens"])  # unchanged
    stream = torch.cat(reference_token_losses(cfg, data, d))  # (test tokens,)
    want = [stream[a:a + T].sum().item() for a in range(0, len(stream), T)]
    assert docs["chunk_nats"] == pytest.approx(want, rel=1e-5)


def test_doc_windows_cover_each_document_once():
    docs = [torch.arange(1, 6).numpy(), torch.arange(10, 13).numpy()]
    w, owner = doc_windows(docs, 2, 0)
    assert owner.tolist() == [0, 0, 0, 1, 1]
    assert w.tolist() == [[0, 1, 2], [2, 3, 4], [4, 5, -1], [0, 10, 11], [11, 12, -1]]


def test_a_data_dir_without_test_split_is_an_error_before_training(tmp_path):
    data = make_data(tmp_path / "old", n_test=None)
    with pytest.raises(NlqError, match="has no test split"):
        train(tiny_config(data), tmp_path / "r", progress=False)
    assert not (tmp_path / "r" / "ckpt").exists()
    # without test_eval the same folder trains
    s = train(tiny_config(data, **{"train.test_eval": False}), tmp_path / "r2", progress=False)
    assert s["status"] == "finished" and "test_loss" not in s


@pytest.mark.parametrize("arch", ["encoder", "prefix"])
def test_bidirectional_test_scoring_masks_alike_and_never_attends_to_padding(tmp_path, arch):
    """An encoder (masked LM) and a prefix-LM look ahead, so a short last window's padding
    would reach real tokens' attention: each window is scored as a plain forward on its real
    tokens alone, with the MLM masks keyed by the window's index, so any micro_batch scores
    the same tokens to the same nats."""
    import contextlib

    from nlq.data.schedule import MLM_TEST, mlm_corrupt
    from nlq.run.batches import Batches
    from nlq.run.scoring import evaluate_test
    from nlq.run.world import World

    data = make_data(tmp_path / "data")
    over = ({"model.arch": "encoder", "train.objective": "mlm", "train.mlm_prob": 0.3}
            if arch == "encoder" else {"model.arch": "prefix", "train.prefix_frac": 0.5})
    got = []
    for B in (2, 3):
        cfg = tiny_config(data, **over, **{"train.micro_batch": B})
        model = Transformer(cfg.model, seed=0).eval()
        batches = Batches(cfg, World(), torch.device("cpu"))
        got.append(evaluate_test(model, batches, World(), contextlib.nullcontext()))
    assert got[0]["tokens"] == got[1]["tokens"]
    assert got[0]["nats"] == pytest.approx(got[1]["nats"], rel=1e-6)

    T, td = cfg.model.block_size, TokenData.open(data)
    windows, owner = doc_windows(td.test_docs(), T, EOT)
    nats = torch.zeros(len(td.test_docs()), dtype=torch.float64)
    short = 0
    with torch.no_grad():
        for k, w in enumerate(windows):
            real = int((w >= 0).sum())  # real tokens of the window (T + 1 when full)
            short += real <= T
            if arch == "encoder":  # inputs w[:-1]: a short window's last token is one of them
                n = min(real, T)
                x, y = mlm_corrupt(w[None, :-1].clamp(min=0), int(td.meta.get("seed", 0)),
                                   (MLM_TEST,), 0.3, td.meta["mask_id"], td.vocab_size, k)
                x, y = x[:, :n], y[:, :n]  # (1, n): the window cut to its real length
                _, loss = model(x, y, reduction="none")
            else:  # inputs w[:-1], targets w[1:]: real ones up to the last real target
                n = real - 1
                x, y = w[None, :n], w[None, 1:n + 1].clone()
                y[:, : batches.prefix_len] = -1
                _, loss = model(x, y, prefix_len=batches.prefix_len, reduction="none")
            nats[owner[k]] += loss.double().sum()
    assert short > 1  # the case: windows with padding
    assert got[0]["nats"] == pytest.approx(nats.tolist(), rel=1e-5)
