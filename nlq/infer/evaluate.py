"""`nlq eval`: a trained model's log-loss on a whole split of a prepared data dir, document by
document, exactly as a run scores its test split at its end (nlq/run/scoring.py), with a
95% interval over documents (a bootstrap that resamples documents, the ratio of summed nats
to summed tokens each time)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from nlq.config import Config, from_dict
from nlq.errors import NlqError
from nlq.infer.load import check_same_data, load_trained, run_config
from nlq.run.batches import Batches
from nlq.run.scoring import evaluate_test
from nlq.run.world import World

BOOTSTRAP_REPS = 2000


def eval_model(path: str | Path, data: str | Path | None = None, split: str = "test",
               seed: int = 0, step: int | None = None) -> dict:
    """The scores, with the checkpoint (or folder) and step they are of: the run's newest
    checkpoint, or `step`."""
    got = load_trained(path, step)
    model, run_data = got.model, got.data
    cfg = run_config(path)
    if data is None and run_data is None:
        raise NlqError(f"{path} does not say which data it trained on: give --data DIR")
    if data is not None:  # asked for: the model's tokenizer, or the scores mean nothing
        check_same_data(run_data, Path(data), "its scores would mean nothing")
    data = Path(data) if data is not None else run_data
    if cfg is None:  # a saved model folder: the default train settings, its model, the data
        cfg = from_dict({"model": dataclasses.asdict(model.cfg), "data": {"dir": str(data)}})
    cfg = Config(model=model.cfg, train=dataclasses.replace(cfg.train, test_eval=False),
                 data=dataclasses.replace(cfg.data, dir=str(data)))
    batches = Batches(cfg, World(), torch.device("cpu"))
    per_doc = evaluate_test(model, batches, World(), contextlib.nullcontext(), split=split,
                            progress=True)
    nats, tokens = np.array(per_doc["nats"]), np.array(per_doc["tokens"], dtype=float)
    if tokens.sum() == 0:
        raise NlqError(f"the {split} split of {data} has no token to score")
    loss = float(nats.sum() / tokens.sum())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(nats), (BOOTSTRAP_REPS, len(nats)))  # (reps, docs)
    boot = nats[picks].sum(1) / np.maximum(tokens[picks].sum(1), 1)
    lo, hi = (float(v) for v in np.percentile(boot, [2.5, 97.5]))
    return {"model": str(path), "checkpoint": str(got.source), "step": got.step,
            "data": str(data), "split": split, "log_loss": loss,
            "ci95": [lo, hi], "ppl": math.exp(min(loss, 700.0)),
            "ppl_ci95": [math.exp(min(lo, 700.0)), math.exp(min(hi, 700.0))],
            "tokens": int(tokens.sum()), "docs": len(nats), "bootstrap_reps": BOOTSTRAP_REPS,
            "per_doc": per_doc}
