"""Every nlq arm as a transformers model of its own model_type, "nlq": NlqConfig holds the
ModelConfig fields, NlqForCausalLM (decoder, prefix) and NlqForMaskedLM (encoder) wrap nlq's
Transformer as `.model`, so the logits are nlq's own, for any query variant, qk_norm, RoPE
or GQA. `register()` (run by `import nlq.hf`) tells AutoConfig, AutoModelForCausalLM and
AutoModelForMaskedLM about them; then `AutoModelForCausalLM.from_pretrained(folder)` loads
what `save_hf` (or `nlq convert --to hf`) wrote. A query registered with
nlq.model.query.register_query must be registered again before loading.

Legend: B batch, T time, V vocab.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from nlq.config import ModelConfig, model_config_from_dict
from nlq.errors import NlqError
from nlq.extras import need
from nlq.model.config import LEGACY_KEYS, upgrade
from nlq.model.transformer import Transformer, prefix_lm_mask, rope_cache

transformers = need("transformers", "model_type nlq (nlq.hf.auto)")
from transformers.modeling_outputs import CausalLMOutput, MaskedLMOutput

FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
DEFAULTS = dataclasses.asdict(ModelConfig())
V5 = int(transformers.__version__.split(".")[0]) >= 5


class NlqConfig(transformers.PretrainedConfig):
    """An nlq ModelConfig as a transformers config: the same field names and values
    (nlq_config() gives the ModelConfig back, validated)."""

    model_type = "nlq"
    attribute_map: ClassVar[dict[str, str]] = {  # HF's common names
        "hidden_size": "d_model", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
        "max_position_embeddings": "block_size"}

    def __init__(self, **kwargs):
        if any(k in kwargs for k in LEGACY_KEYS):  # a folder written before query_args held
            kwargs = upgrade(kwargs)  # the nonlinear query's settings: the same model
        for name in FIELDS:
            value = kwargs.pop(name, DEFAULTS[name])
            setattr(self, name, dict(value) if isinstance(value, dict) else value)  # plain JSON
        kwargs["tie_word_embeddings"] = self.tie_embeddings  # HF ties lm_head by this flag
        super().__init__(**kwargs)

    @classmethod
    def from_nlq(cls, cfg: ModelConfig) -> NlqConfig:
        return cls(**dataclasses.asdict(cfg))

    def nlq_config(self) -> ModelConfig:
        return model_config_from_dict({name: getattr(self, name) for name in FIELDS})


class NlqPreTrainedModel(transformers.PreTrainedModel):
    config_class = NlqConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    # lm_head is wte when tie_embeddings (HF reads this only when tie_word_embeddings is set)
    _tied_weights_keys = ({"model.lm_head.weight": "model.wte.weight"} if V5
                          else ["model.lm_head.weight"])

    def __init__(self, config: NlqConfig):
        super().__init__(config)
        self.model = Transformer(config.nlq_config(), seed=0)
        self.post_init()

    def _init_weights(self, module) -> None:
        """HF's init (N(0, init_std), norms 1, biases 0) for a model built from a config alone
        or weights a folder lacks: for nlq's own init, build nlq's Transformer and to_hf it.
        The RoPE tables are non-persistent buffers, recomputed (transformers 5 builds on
        `meta`)."""
        super()._init_weights(module)
        if isinstance(module, Transformer) and module.cfg.pos_emb == "rope":
            cos, sin = rope_cache(module.cfg)
            with torch.no_grad():
                module.rope_cos.copy_(cos)
                module.rope_sin.copy_(sin)

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value) -> None:
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def _logits(self, input_ids, attention_mask=None, prefix_len=None) -> torch.Tensor:
        """(B, T, V) logits; attention_mask (B, T), 1 = a real token, hides padded keys and,
        for learned positions, numbers the real tokens from 0 (generate pads on the left)."""
        mask = positions = None
        if attention_mask is not None and not bool(attention_mask.all()):
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
            T, dev = input_ids.shape[1], input_ids.device
            keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
            if self.config.arch == "encoder":
                allowed = torch.ones(T, T, dtype=torch.bool, device=dev)
            else:  # causal, or prefix-LM: (T, T) or (B, 1, T, T)
                allowed = prefix_lm_mask(T, 0 if prefix_len is None else prefix_len, dev)
            eye = torch.eye(T, dtype=torch.bool, device=dev)  # a padded query sees itself:
            mask = (allowed & keys) | eye  # no empty softmax row, no NaN
        logits, _ = self.model(input_ids, attn_mask=mask, prefix_len=prefix_len,
                               position_ids=positions)
        return logits


class NlqForCausalLM(NlqPreTrainedModel, transformers.GenerationMixin):
    """A decoder (or prefix-LM) arm: forward(input_ids, labels) -> CausalLMOutput; the loss
    predicts token t+1 from tokens <= t (labels are shifted inside, -100 = no loss)."""

    def __init__(self, config: NlqConfig):
        if config.arch == "encoder":
            raise NlqError("this nlq model is an encoder (arch 'encoder'): load it with "
                           "AutoModelForMaskedLM")
        super().__init__(config)

    def forward(self, input_ids, attention_mask=None, labels=None, prefix_len=None,
                **kwargs) -> CausalLMOutput:
        logits = self._logits(input_ids, attention_mask, prefix_len)
        loss = None
        if labels is not None:
            V = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, V),  # (B*(T-1), V)
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # no KV cache: every step runs the whole sequence (generate with use_cache=False)
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class NlqForMaskedLM(NlqPreTrainedModel):
    """An encoder arm: forward(input_ids, labels) -> MaskedLMOutput, the loss over the
    positions whose label is not -100 (no shift)."""

    def __init__(self, config: NlqConfig):
        if config.arch != "encoder":
            raise NlqError(f"this nlq model is a {config.arch!r} arch, not an encoder: load it "
                           f"with AutoModelForCausalLM")
        super().__init__(config)

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs) -> MaskedLMOutput:
        logits = self._logits(input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),  # (B*T, V)
                                   ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


def register() -> None:
    """Make model_type "nlq" known to AutoConfig and the Auto model classes (idempotent)."""
    transformers.AutoConfig.register("nlq", NlqConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(NlqConfig, NlqForCausalLM, exist_ok=True)
    transformers.AutoModelForMaskedLM.register(NlqConfig, NlqForMaskedLM, exist_ok=True)


def to_hf(model: Transformer) -> NlqForCausalLM | NlqForMaskedLM:
    """A transformers model (eval mode) holding model's weights: the same logits."""
    cls = NlqForMaskedLM if model.cfg.arch == "encoder" else NlqForCausalLM
    hf = cls(NlqConfig.from_nlq(model.cfg)).eval()
    hf.model.load_weights(model.weights())
    return hf


def save_hf(model: Transformer, path: str | Path) -> Path:
    """A folder (config.json with model_type "nlq", model.safetensors) that
    AutoModelForCausalLM (AutoModelForMaskedLM for an encoder) loads after `import nlq.hf`."""
    path = Path(path)
    to_hf(model).save_pretrained(path)
    return path
