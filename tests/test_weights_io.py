"""Weights on disk: save_pretrained / from_pretrained round trip bitwise, tied embeddings
stay tied, K/V/MLP of a linear checkpoint load into a nonlinear model, and the files are
safetensors + JSON (no pickle, unlike the official code's checkpoints)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct

import pytest
import torch
from helpers import tiny_model as tiny

from nlq.config import ModelConfig
from nlq.errors import NlqError
from nlq.model.query import QUERIES
from nlq.model.transformer import Transformer


def trained_like(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model whose every tensor differs from a fresh init (norm gains included)."""
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return m


def states_equal(a: Transformer, b: Transformer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


IDX = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))


ROUND_TRIPS = [{"query": q} for q in sorted(QUERIES)] + [
    {"query": "nonlinear", "bias": True}, {"query": "residual", "tie_embeddings": False},
    {"query": "nonlinear", "pos_emb": "rope", "n_kv_head": 2, "qk_norm": True}]


@pytest.mark.parametrize("kw", ROUND_TRIPS, ids=str)
def test_round_trip_is_bitwise(tmp_path, kw):
    cfg = tiny(**kw)
    m = trained_like(cfg)
    m.save_pretrained(tmp_path / "ckpt")
    back = Transformer.from_pretrained(tmp_path / "ckpt")
    assert back.cfg == cfg
    assert states_equal(m, back)
    with torch.no_grad():
        assert torch.equal(m(IDX)[0], back(IDX)[0])
    if cfg.tie_embeddings:
        assert back.lm_head.weight is back.wte.weight
        assert back.lm_head.weight.data_ptr() == back.wte.weight.data_ptr()
    else:
        assert back.lm_head.weight.data_ptr() != back.wte.weight.data_ptr()
        assert not torch.equal(back.lm_head.weight, back.wte.weight)


def test_tied_embeddings_still_tied_after_load_and_training_step(tmp_path):
    m = trained_like(tiny())
    m.save_pretrained(tmp_path)
    back = Transformer.from_pretrained(tmp_path)
    opt = torch.optim.SGD(back.parameters(), lr=0.1)
    _, loss = back(IDX, IDX)
    loss.backward()
    opt.step()
    assert torch.equal(back.lm_head.weight, back.wte.weight)
    assert not torch.equal(back.wte.weight, m.wte.weight)  # it did train


def test_checkpoint_is_safetensors_and_json_without_pickle(tmp_path):
    m = trained_like(tiny(query="nonlinear"))
    m.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    raw = (tmp_path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]  # safetensors: u64 header size, JSON header, data
    header = json.loads(raw[8 : 8 + n])
    names = set(header) - {"__metadata__"}
    assert names == set(m.weights())
    assert "lm_head.weight" not in names  # the tied alias is not stored twice
    assert all(header[k]["dtype"] == "F32" for k in names)
    for p in tmp_path.iterdir():
        data = p.read_bytes()
        assert not data.startswith(b"\x80")  # pickle protocol 2+ magic
        assert b"PK\x03\x04" not in data[:4]  # torch.save's zip container
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == dataclasses.asdict(m.cfg)
    # header + raw tensor bytes and nothing else: the data offsets tile the body exactly
    spans = sorted(tuple(header[k]["data_offsets"]) for k in names)
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert 8 + n + spans[-1][1] == len(raw)


def test_non_persistent_rope_cache_is_not_saved(tmp_path):
    m = trained_like(tiny(pos_emb="rope"))
    assert not any("rope" in k for k in m.weights())
    m.save_pretrained(tmp_path)
    back = Transformer.from_pretrained(tmp_path)
    assert torch.equal(back.rope_cos, m.rope_cos)


def test_linear_checkpoint_into_nonlinear_model(tmp_path):
    lin = trained_like(tiny(query="linear"))
    lin.save_pretrained(tmp_path)
    torch.manual_seed(123)
    nl = Transformer.from_pretrained(tmp_path, query="nonlinear")
    assert nl.cfg == dataclasses.replace(lin.cfg, query="nonlinear")
    ls, ns = lin.state_dict(), nl.state_dict()
    shared = [k for k in ns if ".attn.q." not in k]
    assert any("k_proj" in k for k in shared) and any("mlp.fc" in k for k in shared)
    for k in shared:  # K, V, O, MLP, norms, embeddings
        assert torch.equal(ns[k], ls[k]), k
    # the query module is fresh: the nonlinear init, not anything from the checkpoint
    torch.manual_seed(123)
    fresh = Transformer(nl.cfg).state_dict()
    q_keys = [k for k in ns if ".attn.q." in k]
    assert q_keys and not any(k in ls for k in q_keys)
    for k in q_keys:
        assert torch.equal(ns[k], fresh[k]), k
    assert torch.all(nl.blocks[0].attn.q.out_norm.weight == 1)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(sorted(QUERIES), repeat=2)))
def test_every_variant_checkpoint_loads_into_every_variant(tmp_path, src, dst):
    """Keys and values are attn.k_proj / attn.v_proj in every variant: everything outside
    the query module moves between variants unchanged."""
    m = trained_like(tiny(query=src))
    m.save_pretrained(tmp_path)
    back = Transformer.from_pretrained(tmp_path, query=dst)
    assert back.cfg.query == dst
    ms, bs = m.state_dict(), back.state_dict()
    shared = [k for k in bs if ".attn.q." not in k]
    assert set(shared) == {k for k in ms if ".attn.q." not in k}
    for k in shared:
        assert torch.equal(bs[k], ms[k]), k


def test_load_weights_reports_what_it_skipped():
    lin = trained_like(tiny(query="linear"))
    nl = Transformer(tiny(query="nonlinear"))
    skipped = nl.load_weights(lin.weights(), strict=False)
    assert sorted(skipped) == sorted(k for k in nl.weights() if ".attn.q." in k)
    with pytest.raises(NlqError, match="do not fit"):
        Transformer(tiny(query="nonlinear")).load_weights(lin.weights())
    # a reshaped tensor is skipped, not broadcast or truncated
    wide = trained_like(tiny(mlp_hidden=80))
    m = Transformer(tiny())
    before = m.blocks[0].mlp.fc.weight.clone()
    skipped = m.load_weights(wide.weights(), strict=False)
    assert "blocks.0.mlp.fc.weight" in skipped
    assert torch.equal(m.blocks[0].mlp.fc.weight, before)
    assert torch.equal(m.blocks[0].attn.k_proj.weight, wide.blocks[0].attn.k_proj.weight)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(NlqError, match="config.json"):
        Transformer.from_pretrained(tmp_path)
    trained_like(tiny()).save_pretrained(tmp_path)
    with pytest.raises(NlqError, match="model.query"):
        Transformer.from_pretrained(tmp_path, query="quadratic")
    with pytest.raises(NlqError, match="model.n_layers"):
        Transformer.from_pretrained(tmp_path, n_layers=3)
    with pytest.raises(NlqError, match="model.n_layer"):
        Transformer.from_pretrained(tmp_path, n_layer="3")
    with pytest.raises(NlqError, match="model.d_model"):
        Transformer.from_pretrained(tmp_path, d_model=30)
