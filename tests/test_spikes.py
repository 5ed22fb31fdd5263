"""Loss spikes: flagged by the rule the docs state, never on a smooth curve, and the same for
a resumed run as for an uninterrupted one."""

from __future__ import annotations

import json

import helpers
import pytest
from helpers import make_data, metrics, tiny_config

from nlq.config import TrainConfig
from nlq.train.loop import train
from nlq.train.spikes import Spikes

one_thread = helpers.one_thread


def feed(losses, grads):
    s = Spikes()
    for i, (loss, g) in enumerate(zip(losses, grads), start=1):
        s.update(i, loss, g)
    return s


def test_smooth_curve_has_no_spike():
    losses = [6.0 * 0.99**i for i in range(300)]
    assert feed(losses, [1.0 / (1 + i) ** 0.5 for i in range(300)]).found == []


def test_loss_and_grad_spikes_are_flagged_at_their_step():
    losses, grads = [3.0] * 100, [0.5] * 100
    losses[59] = 4.6  # step 60: above 1.5 x 3.0
    losses[79] = 4.4  # step 80: below 1.5 x 3.0: not a spike
    grads[69] = 5.1  # step 70: above 10 x 0.5
    found = feed(losses, grads).found
    assert [(f["step"], f["kind"]) for f in found] == [(60, "loss"), (70, "grad")]
    assert found[0]["ref"] == pytest.approx(3.0) and found[0]["value"] == 4.6


def test_no_flag_before_min_history():
    losses = [3.0] * 5 + [30.0]
    assert feed(losses, [1.0] * 6).found == []


def test_state_round_trip_continues_identically():
    losses = [3.0 + (i % 7) * 0.01 for i in range(120)]
    losses[90] = 9.0
    grads = [1.0] * 120
    whole = feed(losses, grads)
    first = feed(losses[:60], grads[:60])
    second = Spikes(json.loads(json.dumps(first.state())))
    for i in range(60, 120):
        second.update(i + 1, losses[i], grads[i])
    assert second.state() == whole.state() and len(whole.found) == 1


def test_warmup_default_is_max_50_or_5_percent():
    assert TrainConfig(max_steps=300).warmup == 50
    assert TrainConfig(max_steps=4000).warmup == 200
    assert TrainConfig(max_steps=4000, warmup_steps=7).warmup == 7


def test_spike_in_a_run_reaches_summary_and_metrics(tmp_path, monkeypatch):
    """A step whose reported loss triples is flagged: the summary lists the spikes the metrics
    log, and every train step is logged."""
    from nlq.train import loop

    real = loop.train_step

    def step(run, s):
        lr, loss, g = real(run, s)
        return (lr, 3 * loss, g) if s == 24 else (lr, loss, g)  # step 25 in metrics' count

    monkeypatch.setattr(loop, "train_step", step)
    data = make_data(tmp_path / "d")
    cfg = tiny_config(data, **{"train.max_steps": 40})
    s = train(cfg, tmp_path / "r", progress=False)
    rows = metrics(tmp_path / "r", "spike")
    assert s["n_spikes"] == len(s["spikes"]) == len(rows) == 1
    assert (rows[0]["step"], rows[0]["of"]) == (25, "loss")
    assert [r["step"] for r in metrics(tmp_path / "r", "train")] == list(range(1, 41))
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["spikes"] == s["spikes"]
