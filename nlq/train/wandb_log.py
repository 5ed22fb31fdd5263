"""Weights & Biases, when a run asks for it (train.wandb_project) and the wandb extra is
installed: the rows of metrics.jsonl, as they are written, from the process that writes them.

metrics.jsonl stays the record the reports read; W&B is a view of it. A run keeps one W&B run
id (in RUN/wandb_id), so a resumed run continues its W&B run: W&B drops the rows of the steps it
has already seen, which a resumed run writes again with the same values (exact resume).
W&B reads its credentials and mode (WANDB_API_KEY, WANDB_MODE=offline) from the environment.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from nlq.extras import need


class WandbLog:
    def __init__(self, project: str, run_dir: Path, config: dict):
        wandb = need("wandb", "train.wandb_project")
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow",
                              config=config, dir=str(run_dir))

    def log(self, row: dict) -> None:
        values = {f"{row['kind']}/{k}": v for k, v in row.items()
                  if k not in ("kind", "step") and isinstance(v, (int, float))}
        self.run.log(values, step=row["step"])

    def close(self) -> None:
        self.run.finish()
