"""nlq/hf/names.py's one map read both ways: nlq -> GPT-2 -> nlq gives back the same
tensors, bitwise (without transformers: the map needs none)."""

from __future__ import annotations

import pytest
import torch
from helpers import o1_model

from nlq.hf.gpt2 import gpt2_state_dict
from nlq.hf.names import to_nlq


@pytest.mark.parametrize("bias", [True, False])
def test_nlq_to_gpt2_to_nlq_is_bitwise_the_same(bias):
    model = o1_model(97, 24, bias=bias)  # linear query, tied embeddings
    assert model.cfg.query == "linear" and model.cfg.tie_embeddings
    want = model.state_dict()
    hf = gpt2_state_dict(model)
    assert hf["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # Conv1D (C, 3C)
    got = to_nlq(hf)
    # GPT-2 always has biases: a model without them comes back with zero ones
    extra = {k: v for k, v in got.items() if k not in want}
    assert all(k.endswith(".bias") and not v.any() for k, v in extra.items())
    assert bool(extra) != bias
    assert set(got) - set(extra) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def test_a_normalised_linear_query_is_not_written_as_gpt2():
    """GPT-2 has no norm on its query: the linear-qnorm arm is refused, naming the setting,
    not exported with its norm silently dropped."""
    import pytest

    from nlq.errors import NlqError
    from nlq.hf.gpt2 import check_gpt2
    from nlq.model import ModelConfig

    cfg = ModelConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16,
                      query_args={"out_norm": "layernorm"})
    with pytest.raises(NlqError, match="out_norm"):
        check_gpt2(cfg)
