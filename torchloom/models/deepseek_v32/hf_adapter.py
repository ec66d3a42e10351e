"""DeepSeek-V3.2 <-> transformers' DeepseekV32ForCausalLM (config.json model_type
"deepseek_v32").

Everything DeepSeek-V3's adapter maps (MLA, MoE, MTP layers) maps the same way; the indexer's
tensors keep transformers' names under the attention (``model.layers.N.self_attn.indexer.
{wq_b, wk, k_norm, weights_proj}``). config.json adds ``index_topk``, ``index_n_heads`` and
``index_head_dim``; transformers' DeepseekV32 always has a low-rank query and interleaved
rotated MLA channels (its config has no ``rope_interleave``), and derives ``mlp_layer_types``
and ``layer_types`` from ``first_k_dense_replace``, so only those derived values are read.
How the indexer is trained (``indexer_train``, ``indexer_loss_coef``) is a training setting no
config.json holds: a loaded model trains it sparsely (weight 1).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from torchloom.models.deepseek_v32.config import DeepSeekV32Config

# DeepseekV32Config's defaults (transformers 5.24) where they differ from DeepseekV3Config's,
# and for its own keys.
_V32_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 163840, "index_topk": 2048, "index_n_heads": 64,
    "index_head_dim": 128,
}  # fmt: skip
_INDEX_KEYS = {"index_topk": "index_topk", "index_n_heads": "index_num_heads",
               "index_head_dim": "index_head_dim"}  # fmt: skip


class DeepSeekV32HFAdapter(DeepSeekV3HFAdapter):
    model_type = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    defaults = DeepSeekV3HFAdapter.defaults | _V32_DEFAULTS
    family_options = DeepSeekV3HFAdapter.family_options | {"mlp_bias": (False,)}
    ignored_keys = DeepSeekV3HFAdapter.ignored_keys | {
        *_INDEX_KEYS, "mlp_layer_types", "layer_types",
    }  # fmt: skip

    def config_from_hf(self, hf: dict[str, Any]) -> DeepSeekV32Config:
        """The DeepSeekV32Config of an HF config.json; ConfigError for what we cannot run."""
        if hf.get("max_position_embeddings") is None:
            hf = hf | {"max_position_embeddings": _V32_DEFAULTS["max_position_embeddings"]}
        if hf.get("rope_interleave", True) is not True:
            raise ConfigError(
                "rope_interleave=false is not a DeepSeek-V3.2 option: transformers' "
                "DeepseekV32 always rotates MLA's channels as interleaved pairs."
            )
        if "q_lora_rank" in hf and not hf["q_lora_rank"]:
            raise ConfigError(
                "q_lora_rank must be set for deepseek_v32: the indexer reads the query latent."
            )
        base = super().config_from_hf(hf)
        layers, dense = base.num_layers, base.first_dense_layers
        derived = {
            "mlp_layer_types": ["dense"] * dense + ["sparse"] * (layers - dense),
            "layer_types": ["indexed_attention"] * layers,
        }
        for key, expected in derived.items():
            if key in hf and list(hf[key]) != expected:
                raise ConfigError(
                    f"{key}={hf[key]} is not supported: torchloom reads deepseek_v32 checkpoints "
                    f"whose {key} follows first_k_dense_replace={dense} ({expected})."
                )
        index = {ours: hf.get(key, _V32_DEFAULTS[key]) for key, ours in _INDEX_KEYS.items()}
        cfg = DeepSeekV32Config(**asdict_shallow(base), **index)
        cfg.validate()
        return cfg

    def config_to_hf(
        self,
        cfg: DeepSeekV32Config,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """A config.json for ``cfg`` that transformers loads as DeepseekV32ForCausalLM."""
        if not cfg.rope_interleave:
            raise ConfigError(
                "transformers' DeepseekV32 rotates MLA's channels as interleaved pairs only; "
                "this model has rope_interleave false and cannot be exported as one."
            )
        hf = super().config_to_hf(cfg, dtype, bos_token_id, eos_token_id)
        hf.pop("rope_interleave")
        return hf | {key: getattr(cfg, ours) for key, ours in _INDEX_KEYS.items()}


def asdict_shallow(cfg: Any) -> dict[str, Any]:
    """The fields of a dataclass as they are (nested configs kept as objects)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}
