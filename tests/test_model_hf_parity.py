"""The linear arm is GPT-2: same logits as transformers' GPT2LMHeadModel with the same
weights (config built locally, nothing downloaded).

Mapping: HF Conv1D stores weights as (in, out), nn.Linear as (out, in): transpose. HF fuses
c_attn = [q | k | v] along the output dim; we keep q (attn.q.proj), k_proj, v_proj apart.
HF "gelu" is the exact erf GELU, as our nn.GELU(); "gelu_new" would be the tanh form.
"""

from __future__ import annotations

import pytest
import torch

from nlq.config import ModelConfig
from nlq.model.transformer import Transformer

transformers = pytest.importorskip("transformers")

C, L, NH, V, BLOCK = 64, 2, 4, 100, 32


def hf_model(attn_implementation: str):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=BLOCK, n_embd=C, n_layer=L, n_head=NH, n_inner=None,
        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=True, attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    assert m.config._attn_implementation == attn_implementation
    with torch.no_grad():  # O(1) weights everywhere, LN gains and biases included
        g = torch.Generator().manual_seed(1)
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "wte" in name or "wpe" in name:  # tied: logits ~ N(0, 0.25^2 C) ~ 2
                p.copy_(0.25 * noise)
            else:  # Conv1D (in, out)
                p.copy_(noise / p.shape[0] ** 0.5)
    return m


def ours_from_hf(hf) -> Transformer:
    cfg = ModelConfig(vocab_size=V, block_size=BLOCK, n_layer=L, n_head=NH, d_model=C,
                      mlp_hidden=4 * C, bias=True, tie_embeddings=True, pos_emb="learned",
                      dropout=0.0, norm_eps=1e-5, query="linear")
    ours = Transformer(cfg).eval()
    h = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    sd = {"wte.weight": h["wte.weight"], "wpe.weight": h["wpe.weight"],
          "ln_f.weight": h["ln_f.weight"], "ln_f.bias": h["ln_f.bias"]}
    for i in range(L):
        p = f"h.{i}."
        w, b = h[p + "attn.c_attn.weight"], h[p + "attn.c_attn.bias"]  # (C, 3C), (3C,)
        for j, name in enumerate(("attn.q.proj", "attn.k_proj", "attn.v_proj")):
            sd[f"blocks.{i}.{name}.weight"] = w[:, j * C : (j + 1) * C].T
            sd[f"blocks.{i}.{name}.bias"] = b[j * C : (j + 1) * C]
        for ours_name, hf_name in (("attn.o_proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                                   ("mlp.proj", "mlp.c_proj")):
            sd[f"blocks.{i}.{ours_name}.weight"] = h[p + hf_name + ".weight"].T
            sd[f"blocks.{i}.{ours_name}.bias"] = h[p + hf_name + ".bias"]
        for ln in ("ln_1", "ln_2"):
            sd[f"blocks.{i}.{ln}.weight"] = h[p + ln + ".weight"]
            sd[f"blocks.{i}.{ln}.bias"] = h[p + ln + ".bias"]
    ours.load_weights(sd)  # strict: every one of our weights is set, nothing extra
    return ours


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_linear_arm_matches_hf_gpt2(impl):
    hf = hf_model(impl)
    ours = ours_from_hf(hf)
    idx = torch.randint(0, V, (3, BLOCK), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(idx).logits
        got, _ = ours(idx)
        # the loss: HF shifts labels inside; we pass shifted targets
        hf_loss = hf(idx, labels=idx).loss
        _, our_loss = ours(idx[:, :-1], idx[:, 1:])
    assert want.abs().max() > 1.0  # non-trivial logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(our_loss, hf_loss, rtol=0, atol=1e-5)


def test_parity_check_is_sensitive_to_the_qkv_split():
    """Swapping q and k in the copy must break parity (the test can fail)."""
    hf = hf_model("eager")
    ours = ours_from_hf(hf)
    with torch.no_grad():
        blk = ours.blocks[0].attn
        w = blk.q.proj.weight.clone()
        blk.q.proj.weight.copy_(blk.k_proj.weight)
        blk.k_proj.weight.copy_(w)
        idx = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(3))
        diff = (ours(idx)[0] - hf(idx).logits).abs().max()
    assert diff > 1e-3
