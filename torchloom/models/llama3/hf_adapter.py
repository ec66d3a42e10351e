"""Llama 3 <-> transformers' LlamaForCausalLM (config.json model_type "llama")."""

from __future__ import annotations

from torchloom.models.hf_adapter import HFAdapter


class Llama3HFAdapter(HFAdapter):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    qk_norm = False
    # LlamaConfig's defaults (head_dim None means hidden_size // num_attention_heads).
    defaults = {
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    family_options = {"mlp_bias": (False,)}
    # transformers 5 ignores it; 4.x only split the same matmuls into slices.
    ignored_keys = frozenset({"pretraining_tp"})
