"""The transformer: decoder (causal LM), encoder (bidirectional, masked LM) and prefix-LM.

Legend: B batch, T time, C = d_model, nh query heads, nkv key/value heads, hs head size,
V vocab. Pre-LN blocks as GPT-2 / nanoGPT. The model is single-device: it never imports
torch.distributed; parallelism wraps it from outside (nlq/train/dist.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from nlq.errors import NlqError
from nlq.model.config import ModelConfig, read_model_config
from nlq.model.init import keyed_normal_
from nlq.model.layers import RMSNorm
from nlq.model.loss import linear_cross_entropy
from nlq.model.query import make_query


def rope_cache(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, hs/2) for rotary embeddings (Su et al. 2021)."""
    hs = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) = the two halves of hs (GPT-NeoX convention). x: (B, h, T, hs)."""
    T = x.shape[-2]
    cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, hs/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Self-attention with a pluggable query (`self.q`), linear keys and values."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hs = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q = make_query(cfg)
        self.k_proj = nn.Linear(cfg.d_model, self.nkv * self.hs, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, self.nkv * self.hs, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hs, cfg.norm_eps)
            self.k_norm = RMSNorm(self.hs, cfg.norm_eps)
        base = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(self.hs)
        base *= cfg.attn_scale_mult  # e.g. the official identity/residual arms' 1/2
        # the folded 1/2 of the nonlinear query; a registered variant may have no scale_factor
        self.scale = base * getattr(self.q, "scale_factor", 1.0)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> q (B, T, C), k and v (B, T, nkv * hs) each: the three projections.
        nlq/model/fast.py's FusedQKVAttention runs them as one matrix product on CUDA."""
        return self.q(x), self.k_proj(x), self.v_proj(x)

    def logits(self, x, mask=None, is_causal=False, rope=None):
        """The pre-softmax attention logits of forward(x, ...): (logits (B, nh, T, T), allowed
        (bool, broadcastable to it), True where a query may attend). For measuring their range
        (the QK-norm arms: a normalised q.k times the scale is bounded), never for training."""
        T = x.shape[1]
        q, k, _ = self.heads(x, rope)
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)  # (B, nh, T, hs): GQA's sharing
        logits = (q @ k.transpose(-2, -1)).float() * self.scale  # (B, nh, T, T)
        if mask is not None:
            allowed = mask
        elif is_causal:
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        else:
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device)
        return logits, allowed

    def heads(self, x, rope=None):
        """x (B, T, C) -> q (B, nh, T, hs), k and v (B, nkv, T, hs): projected, split into
        heads, q and k normalised (qk_norm) and rotated (rope) as attention uses them."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.view(B, T, self.nh, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x, mask=None, is_causal=False, rope=None):
        B, T, C = x.shape
        q, k, v = self.heads(x, rope)
        if torch.is_autocast_enabled(x.device.type):
            # what autocast does to attention's inputs, done here because under torch.func.vmap
            # (seeds trained as one stacked model, nlq/train/stack.py) autocast never reaches
            # it: the nonlinear query's fp32 sum would meet bf16 keys
            dt = torch.get_autocast_dtype(x.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.nkv != self.nh,
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_width, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_width, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, mask=None, is_causal=False, rope=None):
        # The query sees ln_1(x): "X is the block's pre-attention normalised input".
        x = x + self.attn(self.ln_1(x), mask, is_causal, rope)
        return x + self.mlp(self.ln_2(x))


def prefix_lm_mask(T: int, prefix_len, device=None) -> torch.Tensor:
    """Boolean (T, T) or (B, 1, T, T) mask, True = may attend: causal, plus full attention
    among the first prefix_len positions. prefix_len: int or LongTensor (B,)."""
    i = torch.arange(T, device=device)
    causal = i[:, None] >= i[None, :]  # (T, T)
    if isinstance(prefix_len, int):
        return causal | (i[None, :] < prefix_len) & (i[:, None] < prefix_len)
    p = prefix_len.to(device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    return causal | ((i[None, :] < p) & (i[:, None] < p))  # (B, 1, T, T)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        """seed keys every parameter's initial values (reset_parameters); None draws one
        from torch's global generator, so torch.manual_seed still decides the init."""
        super().__init__()
        self.cfg = cfg
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))
        self.seed = int(seed)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if cfg.pos_emb == "rope":
            cos, sin = rope_cache(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()
        # Where the training loss comes chunk by chunk from the hidden states
        # (nlq/model/loss.py): None = on CPU only, where it saves page faults on every step;
        # on a GPU the plain logits + F.cross_entropy is one fused kernel pair that
        # torch.compile can fold into the model's graph (benchmarks/RESULTS.md, GPU section).
        # True / False force either path (e.g. True for a vocabulary too large for memory).
        self.chunked_loss: bool | None = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 / nanoGPT init: N(0, 0.02) for weights and embeddings, zero biases, residual
        output projections N(0, 0.02 / sqrt(2 n_layer)); norms at weight 1, bias 0.

        Each tensor is drawn from its own generator, keyed by (seed, parameter name): two
        arms built with the same seed start with bitwise the same values in every tensor they
        share by name and shape (embeddings, K, V, output projections, ...), whatever else
        differs (a wider MLP, another query module), so seed-paired arms differ only where
        their architectures do. With model.init_nested, tensors of other shapes share their
        common units too (nlq/model/init.py): a wider MLP's first hidden units are the
        narrower one's."""
        std, nested = self.cfg.init_std, self.cfg.init_nested
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                if self.cfg.tie_embeddings and mod is self.lm_head:
                    continue  # its weight is wte's, drawn under the name wte.weight
                resid = name.endswith(("attn.o_proj", "mlp.proj"))
                # mlp.proj's units (the MLP's hidden units) are its input columns
                keyed_normal_(mod.weight, resid_std if resid else std, self.seed,
                              f"{name}.weight", nested, units_last=name.endswith("mlp.proj"))
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Embedding):
                keyed_normal_(mod.weight, std, self.seed, f"{name}.weight", nested)
            elif isinstance(mod, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(mod.weight)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)

    def forward(self, idx, targets=None, attn_mask=None, prefix_len=None, reduction="mean",
                return_logits=None, position_ids=None):
        """idx: (B, T) token ids. targets: (B, T), -1 = no loss. attn_mask: bool, broadcastable
        to (B, nh, T, T), True = may attend; it replaces the arch's default mask. prefix_len:
        int or (B,) for the prefix-LM. reduction: "mean", "sum" or "none" (per token, (B, T)).
        position_ids: (B, T) indices into the learned position table (default 0..T-1), for
        left-padded batches; RoPE is relative, so a shift of every real token changes nothing.
        Returns (logits (B, T, V) or None, loss or None). Logits are returned when there are
        no targets, when return_logits=True, or when the loss is not chunked (self.chunked_loss;
        by default on CPU it is: the loss comes from the hidden states chunk by chunk,
        nlq/model/loss.py, and the (B, T, V) logits are never formed)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        mask, is_causal = attn_mask, False
        if mask is None:
            if self.cfg.arch == "prefix" and prefix_len is not None:
                mask = prefix_lm_mask(T, prefix_len, idx.device)
            else:
                is_causal = self.cfg.arch != "encoder"
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device) if position_ids is None
                             else position_ids)
        x = self.drop(x)
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos_emb == "rope" else None
        for block in self.blocks:
            x = block(x, mask, is_causal, rope)
        x = self.ln_f(x)
        chunked = self.chunked_loss if self.chunked_loss is not None else x.device.type == "cpu"
        if targets is not None and chunked and not return_logits and reduction != "none":
            loss = linear_cross_entropy(
                x.view(B * T, -1), self.lm_head.weight, targets.reshape(B * T),  # (B*T, C), (B*T,)
                reduction=reduction, ignore_index=-1,
            )
            return None, loss
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            # the loss in fp32 or wider: autocast runs cross-entropy so from the bf16 logits
            # in its own kernels; without it, bf16 logits are widened here first (on a GPU the
            # (B T, V) fp32 copy cost ~8% of an eager GPT-3 small step, benchmarks/RESULTS.md)
            wide = (logits.dtype if torch.is_autocast_enabled(logits.device.type)
                    else torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(
                logits.to(wide).view(B * T, -1), targets.reshape(B * T),  # (B*T, V), (B*T,)
                ignore_index=-1, reduction="sum" if reduction == "mean" else reduction,
            )
            if reduction == "mean":  # no target at all: 0, as the chunked loss, not NaN
                loss = loss / (targets != -1).sum().clamp(min=1)
            if reduction == "none":
                loss = loss.view(B, T)  # (B, T)
        return logits, loss

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """idx (B, T0) -> (B, T0 + n): continuations sampled with temperature, top_k, top_p,
        seed and stop_token (nlq/model/generate.py; temperature=0 is greedy)."""
        from nlq.model.generate import generate

        return generate(self, idx, max_new_tokens, **sampling)

    # -- parameter counts ------------------------------------------------------------
    def num_params(self, non_embedding: bool = False) -> int:
        """A tied matrix counts once. Non-embedding drops the token and position tables
        (the paper's convention, docs/paper.md, "Parameter counts")."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            # an untied output head is a parameter of its own: it stays in non-embedding
        return n

    # -- weights on disk -------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """State dict without the tied alias (safetensors stores no shared tensors)."""
        sd = self.state_dict()
        if self.cfg.tie_embeddings:
            sd.pop("lm_head.weight")
        return {k: v.detach().contiguous() for k, v in sd.items()}

    def load_weights(self, sd: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
        """Load a weights() dict. strict=False loads what matches by name and shape (e.g.
        K/V/MLP of a linear checkpoint into a nonlinear model) and returns what was skipped."""
        own = self.state_dict()
        if self.cfg.tie_embeddings:
            own.pop("lm_head.weight")
        skipped = [k for k in own if k not in sd or sd[k].shape != own[k].shape]
        extra = [k for k in sd if k not in own]
        if strict and (skipped or extra):
            raise NlqError(
                f"weights do not fit this model: missing or reshaped {skipped[:4]}, "
                f"unexpected {extra[:4]}"
            )
        with torch.no_grad():
            for k, v in own.items():
                if k in sd and sd[k].shape == v.shape:
                    v.copy_(sd[k])
        return skipped

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.weights(), str(path / "model.safetensors"))
        cfg = {f: getattr(self.cfg, f) for f in self.cfg.__dataclass_fields__}
        (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides) -> Transformer:
        """Load save_pretrained() output. overrides change model keys (e.g. query=...); the
        weights that still fit are loaded and the rest keep their init."""
        path = Path(path)
        try:
            raw = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise NlqError(f"no config.json in {path}") from None
        raw.update(overrides)
        cfg = read_model_config(raw)  # old nl_* keys read as query_args
        model = cls(cfg)
        model.load_weights(load_file(str(path / "model.safetensors")), strict=not overrides)
        return model
