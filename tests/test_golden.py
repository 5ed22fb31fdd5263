"""Golden per-step losses: the `tiny` preset on CPU, fp32, guards against a silently changed
computation (a refactor of the model, the query kernels, the loss, the optimizer, the batch
schedule or the learning-rate schedule).

The embedded corpus is prepared exactly as `nlq reproduce` prepares it (bpe:8192); each arm
trains GOLDEN_STEPS steps with its train loss and grad norm logged every step, compared with
tests/golden/tiny_cpu.json. The data's sha256 is checked first, so a change of the data
pipeline is told apart from a change of the model.

Tolerance: the same code on another CPU or thread count sums in another order. Measured
here over these steps: 2 threads against 1, and the nonlinear query's plain modules against
its fused CPU kernel (the same math, other rounding), differ by at most 1.3e-7 relative.
RTOL = 1e-4 is ~1000x that and 20x below the smallest change tried (lr 1% higher: 2.2e-3;
init_std 0.0201 or norm_eps 1e-6 instead of 0.02 and 1e-5: 5e-3).

Regenerate after an intended change: `python tests/test_golden.py --regenerate` (say why in
the commit).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "tiny_cpu.json"
GOLDEN_STEPS = 12
ARMS = {"linear": {}, "nonlinear": {"model.query": "nonlinear"}}
RTOL = 1e-4


def prepare(out: Path) -> dict:
    """The embedded corpus with bpe:8192, as `nlq reproduce --preset tiny` prepares it."""
    if not (out / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "nlq", "prepare", "--source", "embedded",
                        "--tokenizer", "bpe:8192", "--out", str(out)], check=True,
                       capture_output=True, text=True)
    return json.loads((out / "meta.json").read_text())


def trajectory(data_dir: Path, run_dir: Path, arm: str) -> dict:
    """Per-step train loss and grad norm, and the final val loss, of one arm."""
    from nlq.config import load_config
    from nlq.train.loop import train

    cfg = load_config("tiny", {
        **ARMS[arm], "data.dir": str(data_dir), "train.max_steps": GOLDEN_STEPS,
        "train.log_interval": 1, "train.eval_interval": GOLDEN_STEPS,
        "train.eval_batches": 2, "train.ckpt_interval": GOLDEN_STEPS,
        "train.warmup_steps": 4, "train.test_eval": False,  # warmup and cosine, both
        "train.device": "cpu", "train.precision": "fp32"})
    summary = train(cfg, run_dir, progress=False)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    return {"loss": [r["loss"] for r in train_rows],
            "grad_norm": [r["grad_norm"] for r in train_rows],
            "val_loss": summary["val_loss"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden") / "embedded-bpe8192"
    return d, prepare(d)


def test_golden_data_is_the_recorded_data(data):
    _, meta = data
    golden = json.loads(GOLDEN.read_text())
    assert meta["sha256"] == golden["data_sha256"], (
        "the prepared embedded corpus changed (tokenizer training or the split): the golden "
        "losses cannot be compared; regenerate them if the change is intended")


@pytest.mark.parametrize("arm", list(ARMS))
def test_golden_losses(data, tmp_path, arm):
    data_dir, meta = data
    golden = json.loads(GOLDEN.read_text())
    if meta["sha256"] != golden["data_sha256"]:
        pytest.skip("data differs from the golden run's (see test_golden_data_is_the_recorded_data)")
    got, want = trajectory(data_dir, tmp_path / arm, arm), golden["arms"][arm]
    assert len(got["loss"]) == len(want["loss"]) == GOLDEN_STEPS
    for key in ("loss", "grad_norm"):
        for step, (g, w) in enumerate(zip(got[key], want[key]), start=1):
            assert g == pytest.approx(w, rel=RTOL), f"{arm}: {key} at step {step}: {g} vs {w}"
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=RTOL)


def regenerate() -> None:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        meta = prepare(tmp / "data")
        arms = {a: trajectory(tmp / "data", tmp / a, a) for a in ARMS}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({
        "what": f"tiny preset, CPU fp32, {GOLDEN_STEPS} steps, loss and grad norm per step",
        "torch": torch.__version__, "data_sha256": meta["sha256"], "arms": arms},
        indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_golden.py --regenerate")
    regenerate()
