"""The `checkpoint` section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    save_final_model: bool = True
    """At the end of training write the model (safetensors + config.json + tokenizer.json) to
    <output_dir>/model, loadable with `torchloom.checkpoint.load_model`."""
    initial_load_hf: str = ""
    """Start from a Hugging Face model folder (config.json + safetensors) instead of random
    weights. The architecture then comes from its config.json (--model.name must name its
    family; --model.flavor is not used; --model.overrides must be empty); --model.attn_backend,
    --model.norm_impl and --model.transforms still apply."""
    export_hf: bool = False
    """At the end of training also write a Hugging Face folder (config.json, safetensors and the
    run's tokenizer) to <output_dir>/hf, loadable with transformers' from_pretrained."""
