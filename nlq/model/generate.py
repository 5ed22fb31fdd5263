"""Sampling from a decoder: temperature, top-k, top-p (nucleus), a seed, a stop token.

No KV cache: every new token re-runs the (cropped) context, which keeps the model code
untouched and is fast enough for the small models nlq trains on a CPU. The context is cropped
to the last block_size tokens, as the model was trained."""

from __future__ import annotations

import math

import torch

from nlq.errors import NlqError


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise NlqError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise NlqError(f"top-k must be >= 1, got {top_k}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise NlqError(f"top-p must be in (0, 1], got {top_p}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise NlqError("top-k and top-p choose among tokens to sample: at temperature 0 (the "
                       "most likely token, greedy) they have no effect; give one or the other")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """logits (B, V) with everything outside the top-k, then outside the smallest set whose
    probability reaches top_p, set to -inf (the most likely token always stays)."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V) each
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_token: int | None = None) -> torch.Tensor:
    """idx (B, T0) int64 -> (B, T0 + n), n <= max_new_tokens: n is shorter only when every
    row has produced stop_token (rows that stopped earlier are padded with it).
    temperature 0 is greedy (argmax, no randomness). seed fixes the draws (a generator of its
    own: torch's global generator is left alone)."""
    check_sampling(temperature, top_k, top_p)
    if model.cfg.arch == "encoder":
        raise NlqError("an encoder (bidirectional) model cannot generate left to right")
    if idx.ndim != 2 or idx.size(1) == 0:
        raise NlqError("generate needs a (B, T) prompt of at least one token")
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=idx.device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ())))
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    try:
        for _ in range(max_new_tokens):
            ctx = idx[:, -model.cfg.block_size:]  # (B, <= block_size)
            logits, _ = model(ctx)
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(dim=-1)  # (B,)
            else:
                logits = filter_logits(logits / temperature, top_k, top_p)
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
            if stop_token is not None:
                nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
                done |= nxt == stop_token
            idx = torch.cat([idx, nxt[:, None]], dim=1)  # (B, T + 1)
            if stop_token is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return idx
