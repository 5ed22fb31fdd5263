"""A run's scoring: the validation loss, a sum of nats over a sum of target tokens on the
fixed val windows, all-reduced over the ranks (so it is the same for every world size); and
the test split's loss, once, at the end of a run, per document and per fixed-length chunk of
the test stream (the units the report's bootstrap resamples: nlq/report/bootstrap.py).
Training scores with both (nlq/train/loop.py); `nlq eval` scores a trained model's split
the same way as the test split (nlq/infer/evaluate.py)."""

from __future__ import annotations

import contextlib
import math
import sys

import numpy as np
import torch

from nlq.run.batches import Batches
from nlq.run.world import World, all_reduce_sum


@torch.no_grad()
def evaluate(wrapped: torch.nn.Module, batches: Batches, world: World,
             autocast: contextlib.AbstractContextManager) -> tuple[float, float]:
    """(val loss, val perplexity) of the model on this rank's val chunks, all ranks."""
    wrapped.eval()
    nats = torch.zeros((), dtype=torch.float64, device=batches.device)
    count = torch.zeros((), dtype=torch.float64, device=batches.device)
    for i in range(batches.val.shape[0]):
        x, y = batches.val_chunk(i)
        with autocast:
            _, loss = wrapped(x, y, prefix_len=batches.prefix_len, reduction="sum")
        nats += loss.double()
        count += (y >= 0).sum()
    all_reduce_sum(nats, world)
    all_reduce_sum(count, world)
    wrapped.train()
    loss = (nats / count).item()
    return loss, math.exp(min(loss, 700.0))  # exp overflows a float beyond ~709


@torch.no_grad()
def evaluate_test(wrapped: torch.nn.Module, batches: Batches, world: World,
                  autocast: contextlib.AbstractContextManager, split: str = "test",
                  progress: bool = False) -> dict:
    """The whole test split: {"doc", "nats", "tokens"} per test document (the sum of nats and
    the number of scored tokens), and {"chunk_size", "chunk_nats", "chunk_tokens"} per chunk
    of the test stream, identical on every rank.

    Each document is scored as the model reads documents in training, after an end-of-text
    token: [eot] + doc, cut into consecutive windows of T + 1 tokens (the last one shorter,
    padded with targets that carry no loss), so every token of the document, its closing
    end-of-text included, is predicted once with the context of its own window (a decoder's
    objective; a prefix-LM scores the positions after each window's prefix, a masked LM the
    masked ones). Where attention looks ahead (encoder, prefix) the padding is kept out of it
    (Batches.test_inputs_targets). Rank r runs batches r, r+W, ... of micro_batch windows;
    the sums are all-reduced.

    The test stream is every scored token in the order scored (document by document, window
    by window); chunk k holds its tokens k*T .. (k+1)*T - 1, T = block_size scored tokens
    (the last chunk fewer). One document can hold much of a small test split (44% of the
    `small` preset's: README, "What the main command measures"), so a bootstrap over
    documents is dominated by it; chunks of equal size are not. The chunks' sums are the
    documents' sums cut otherwise (tests/test_test_split.py); the test loss stays total nats
    over total tokens of the documents."""
    wrapped.eval()
    try:
        def score(x, y, mask):  # (b, T) inputs and targets -> (1, b, T) losses
            return wrapped(x, y, attn_mask=mask, prefix_len=batches.prefix_len,
                           reduction="none")[1][None]

        return score_test(score, 1, batches, world, autocast, split, progress)[0]
    finally:
        wrapped.train()


def score_test(score, K: int, batches: Batches, world: World,
               autocast: contextlib.AbstractContextManager, split: str = "test",
               progress: bool = False) -> list[dict]:
    """evaluate_test for K models at once (a stack's members, nlq/train/stacked.py): score(x,
    y, mask) gives the K models' per-token losses (K, b, T) on (b, T) inputs and targets, -1 =
    no target, under the attention mask of Batches.test_inputs_targets (None: the arch's own);
    one dict as evaluate_test's per model."""
    docs = batches.data.docs(split)  # `nlq eval --split` scores another split the same way
    windows, owner = doc_windows(docs, batches.T, int(batches.data.meta["eot_id"]))
    B, W, dev = batches.t.micro_batch, world.size, batches.device
    n_chunks = math.ceil(len(windows) / (B * W)) * W  # every rank runs as many forwards
    nats = torch.zeros(K, len(docs), dtype=torch.float64, device=dev)
    count = torch.zeros(len(docs), dtype=torch.float64, device=dev)
    # per scored slot of every window (16 bytes a test token): the chunks are cut from these
    slot_nats = torch.zeros(K, len(windows), batches.T, dtype=torch.float64, device=dev)
    slot_scored = torch.zeros(len(windows), batches.T, dtype=torch.float64, device=dev)
    chunks = range(world.rank, n_chunks, W)
    if progress and world.main:  # `nlq eval` of a large split: minutes on a CPU
        from tqdm import tqdm

        from nlq.progress import bar_interval

        chunks = tqdm(chunks, desc=f"scoring {split}", unit="batch", file=sys.stderr,
                      dynamic_ncols=True, mininterval=bar_interval())
    for c in chunks:
        w = windows[c * B:(c + 1) * B]  # (b, T+1), b <= B; empty for a padding chunk
        if len(w) == 0:
            w = torch.full((1, batches.T + 1), -1, dtype=torch.long)
        x, y, mask = batches.test_inputs_targets(w, c)
        with autocast:
            loss = score(x, y, mask)  # (K, b, T)
        rows = owner[c * B:(c + 1) * B].to(dev)
        if len(rows):
            nats.index_add_(1, rows, loss.double().sum(2))
            count.index_add_(0, rows, (y >= 0).sum(1).double())
            slot_nats[:, c * B:c * B + len(rows)] = loss.double()
            slot_scored[c * B:c * B + len(rows)] = (y >= 0).double()
    for t in (nats, count, slot_nats, slot_scored):
        all_reduce_sum(t, world)
    scored = slot_scored.flatten() > 0  # (N*T,) in stream order
    which = torch.arange(int(scored.sum()), device=dev) // batches.T  # (scored,) its chunk
    n_units = int(which[-1]) + 1 if len(which) else 0
    chunk_tokens = torch.bincount(which, minlength=n_units).tolist()
    out = []
    for k in range(K):
        chunk_nats = torch.zeros(n_units, dtype=torch.float64, device=dev).index_add_(
            0, which, slot_nats[k].flatten()[scored])
        out.append({"doc": list(range(len(docs))), "nats": nats[k].tolist(),
                    "tokens": [int(n) for n in count.tolist()],
                    "chunk_size": batches.T, "chunk_nats": chunk_nats.tolist(),
                    "chunk_tokens": chunk_tokens})
    return out


def doc_windows(docs: list, T: int, eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows (N, T+1), -1 = padding; owner (N,): each window's document index)."""
    rows, owner = [], []
    for j, d in enumerate(docs):
        s = torch.from_numpy(np.concatenate([[eot], np.asarray(d, dtype=np.int64)]))
        for a in range(0, len(d), T):
            w = torch.full((T + 1,), -1, dtype=torch.long)
            piece = s[a:a + T + 1]  # (<= T+1,)
            w[:len(piece)] = piece
            rows.append(w)
            owner.append(j)
    return torch.stack(rows), torch.tensor(owner, dtype=torch.long)


@torch.no_grad()
def attention_logit_range(wrapped: torch.nn.Module, batches: Batches,
                          autocast: contextlib.AbstractContextManager, rows: int = 4) -> dict | None:
    """Per layer, the largest |pre-softmax attention logit| and the logits' sd over the
    positions a query may attend, on the first `rows` sequences of val chunk 0: what an
    attention scale does (a QK-norm model's q.k * scale is bounded by sqrt(hs) times the scale
    multiplier and the norms' gains). None where the model runs compiled block by block (the
    blocks' graphs would not call the hooks). Every rank must call it (FSDP gathers)."""
    from nlq.model.transformer import Attention

    model = getattr(wrapped, "module", wrapped)  # DDP's module
    model = getattr(model, "_orig_mod", model)  # the eager model under whole-model compile
    if any(type(m).__name__ == "OptimizedModule" for m in model.modules()):
        return None
    stats: list[tuple[float, float]] = []

    def measure(mod, args, kwargs, _out):
        logits, allowed = mod.logits(*args, **kwargs)  # (b, nh, T, T), broadcastable bool
        vals = logits.masked_select(allowed.expand_as(logits))  # (allowed,)
        stats.append((vals.abs().max().item(), vals.std().item()))

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    hooks = [m.register_forward_hook(measure, with_kwargs=True) for m in layers]
    was_training = model.training
    model.eval()
    try:
        x, _ = batches.val_chunk(0)
        with autocast:
            model(x[:rows], prefix_len=batches.prefix_len)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {"rows": int(min(rows, len(x))),  # 5 significant digits: a range, not a loss
            "max_abs": [float(f"{a:.5g}") for a, _ in stats],
            "sd": [float(f"{s:.5g}") for _, s in stats]}
