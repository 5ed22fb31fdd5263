"""Hugging Face interop (needs `transformers`, an optional dependency).

- names.py: the one map between nlq's tensor names and layouts and GPT-2's, both directions.
- gpt2.py: the linear arm as a plain transformers GPT-2 (`nlq convert --to gpt2`).
- from_gpt2.py: a GPT-2 folder's weights under nlq's names (train.init_from).
- auto.py: every arm as a transformers model of model_type "nlq" (NlqConfig, NlqForCausalLM,
  NlqForMaskedLM; `nlq convert --to hf`). Importing nlq.hf registers them with AutoConfig,
  AutoModelForCausalLM and AutoModelForMaskedLM when transformers is installed, so
  `import nlq.hf` then `AutoModelForCausalLM.from_pretrained(folder)` loads such a folder.
- patch.py: `patch_queries(model, query="nonlinear")` swaps the query projection of a
  transformers GPT-2 or Llama-family model for an nlq query module, in place.

Without transformers, `import nlq.hf` still works (names.py and from_gpt2.py need none); the
others raise an error that says to install it.
"""

from __future__ import annotations

from importlib.util import find_spec

if find_spec("transformers") is not None:
    from nlq.hf.auto import register

    register()


def patch_queries(model, query: str = "nonlinear", **kwargs):
    """nlq.hf.patch.patch_queries (documented there), imported on first use."""
    from nlq.hf.patch import patch_queries as patch

    return patch(model, query, **kwargs)
