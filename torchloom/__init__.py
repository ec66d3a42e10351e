"""torchloom: PyTorch-native pre-training, post-training and RL of large generative models."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

__version__ = "0.1.0"


def from_hf(
    hf_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Load a Hugging Face folder (config.json + safetensors) as a torchloom model in eval mode.

    The family comes from ``model_type`` ('llama' -> llama3, 'qwen3' -> qwen3); weights are
    fp32 unless ``dtype`` ('bf16', 'fp32' or a torch dtype) is given. ``model(token_ids)``
    returns logits of shape (batch, seq, vocab). See docs/hf.md.
    """
    # Imported here so that `import torchloom` stays light.
    from torchloom.checkpoint.hf import from_hf as load

    return load(hf_dir, dtype, device)


__all__ = ["__version__", "from_hf"]
