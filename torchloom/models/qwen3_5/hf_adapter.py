"""Qwen3.5 <-> transformers' Qwen3_5ForCausalLM ("qwen3_5_text") and Qwen3_5MoeForCausalLM
("qwen3_5_moe_text"): Qwen3-Next's adapter with separate DeltaNet projections, a dense or an
always-renormalised MoE feed-forward, and MRoPE's text-irrelevant keys accepted.

The released Qwen3.5 checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``,
model_type "qwen3_5" / "qwen3_5_moe"): their language model is read from ``text_config`` and
``model.language_model.*``, the vision encoder (``model.visual.*``) is skipped. Export writes
the text model (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchloom.config.errors import ConfigError
from torchloom.models.qwen3_next.config import Qwen3NextConfig
from torchloom.models.qwen3_next.hf_adapter import _DEFAULTS, Qwen3NextHFAdapter

# The keys of Qwen3_5TextConfig besides the common ones, and its defaults where they differ.
_TEXT_DEFAULTS = _DEFAULTS | {"intermediate_size": 12288, "num_key_value_heads": 4}
_TEXT_KEYS = frozenset({
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types", "full_attention_interval",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "sliding_window",
    "max_window_layers",
})  # fmt: skip
_NESTED = "model.language_model."


class Qwen3_5HFAdapter(Qwen3NextHFAdapter):
    model_type = "qwen3_5_text"
    architecture = "Qwen3_5ForCausalLM"
    reads_also = ("qwen3_5",)
    multimodal_architecture: ClassVar[str] = "Qwen3_5ForConditionalGeneration"
    """The released checkpoints' class (model_type ``reads_also``)."""
    defaults = _TEXT_DEFAULTS
    fused_projections = False
    ffn_kinds = ("swiglu",)
    ignored_keys = _TEXT_KEYS | {"intermediate_size"}
    # Text tokens hold one position on every MRoPE axis: the sections change nothing.
    ignored_rope_keys = ("mrope_section", "mrope_interleaved")

    def config_from_hf(self, hf: dict[str, Any]) -> Qwen3NextConfig:
        if hf.get("model_type") in self.reads_also:
            hf = self._text_config(hf)
        return super().config_from_hf(hf)

    def _text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """A multimodal config.json's language model, as the text model's config.json."""
        architectures = hf.get("architectures")
        if architectures and list(architectures) != [self.multimodal_architecture]:
            raise ConfigError(
                f"architectures {architectures} is not supported for model_type "
                f"{hf['model_type']!r}; torchloom reads the language model of "
                f"{self.multimodal_architecture} checkpoints."
            )
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError(f"a {hf['model_type']!r} config.json needs a text_config.")
        text = {k: v for k, v in hf["text_config"].items() if k != "architectures"}
        text["model_type"] = self.model_type
        if "tie_word_embeddings" in hf:  # the whole model's head decides
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return text

    def held_name(self, hf_name: str, available: set[str]) -> str:
        nested = _NESTED + hf_name.removeprefix("model.")
        if hf_name not in available and hf_name.startswith("model.") and nested in available:
            return nested  # a multimodal checkpoint's language model
        return hf_name

    def from_hf_name(self, hf_name: str) -> str | None:
        if hf_name.startswith("model.visual."):
            return None  # the vision encoder: not read (module docstring)
        if hf_name.startswith(_NESTED):
            hf_name = "model." + hf_name.removeprefix(_NESTED)
        return super().from_hf_name(hf_name)


class Qwen3_5MoeHFAdapter(Qwen3_5HFAdapter):
    model_type = "qwen3_5_moe_text"
    architecture = "Qwen3_5MoeForCausalLM"
    reads_also = ("qwen3_5_moe",)
    multimodal_architecture = "Qwen3_5MoeForConditionalGeneration"
    # Qwen3_5MoeTextConfig has no norm_topk_prob (always renormalised), no dense layers.
    defaults = _DEFAULTS | {"num_experts": 256, "num_experts_per_tok": 8}
    ffn_kinds = ("moe",)
    ignored_keys = _TEXT_KEYS | {
        "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
        "num_experts", "output_router_logits", "router_aux_loss_coef",
    }  # fmt: skip
