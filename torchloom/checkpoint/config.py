"""The `checkpoint` section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    save_final_model: bool = True
    """At the end of training write the model (safetensors + config.json + tokenizer.json) to
    <output_dir>/model, loadable with `torchloom.checkpoint.load_model`."""
