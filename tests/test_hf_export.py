"""The linear arm written as transformers' GPT-2: the same logits, in memory and through a
saved folder; what GPT-2 cannot express is refused, naming it."""

from __future__ import annotations

import pytest
import torch
from helpers import o1_model

from nlq.errors import NlqError
from nlq.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
from nlq.hf.gpt2 import save_gpt2, to_gpt2


def model(**kw) -> Transformer:
    return o1_model(97, 24, **kw)


@pytest.mark.parametrize("kw", [{"bias": True}, {"bias": False},
                                {"bias": True, "tie_embeddings": False}])
def test_gpt2_export_has_the_same_logits(kw, tmp_path):
    ours = model(**kw)
    idx = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, _ = ours(idx)
        hf = to_gpt2(ours)
        assert (hf(idx).logits - want).abs().max() < 1e-5
        save_gpt2(ours, tmp_path / "gpt2")
        loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
        assert (loaded(idx).logits - want).abs().max() < 1e-5
        auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
        assert torch.equal(auto(idx).logits, loaded(idx).logits)


@pytest.mark.parametrize("kw,what", [({"query": "nonlinear"}, "query 'nonlinear'"),
                                     ({"arch": "encoder"}, "arch 'encoder'"),
                                     ({"pos_emb": "rope"}, "pos_emb 'rope'"),
                                     ({"qk_norm": True}, "qk_norm"),
                                     ({"attn_scale_mult": 0.5}, "attention scale")])
def test_what_gpt2_cannot_express_is_refused(kw, what):
    with pytest.raises(NlqError, match=what):
        to_gpt2(model(**kw))
