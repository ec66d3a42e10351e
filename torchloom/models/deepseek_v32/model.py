"""DeepSeek-V3.2's model: DeepSeek-V3's (the generic decoder plus multi-token prediction) with
DeepSeek sparse attention layers. In the indexer warm-up (``indexer_train`` 'warmup') every
parameter but the indexers' is frozen as the model is built, so every layout and the optimizer
(which takes trainable parameters only) see the same split."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchloom.models.deepseek_v3.model import DeepSeekV3

if TYPE_CHECKING:  # the config builds this model: the model needs its type only
    from torchloom.models.deepseek_v32.config import DeepSeekV32Config


class DeepSeekV32(DeepSeekV3):
    """The DeepSeek-V3 model whose attention layers are 'dsa'."""

    def __init__(self, cfg: DeepSeekV32Config) -> None:
        super().__init__(cfg)
        if cfg.indexer_train == "warmup":
            for name, param in self.named_parameters():
                param.requires_grad_(".indexer." in name)
