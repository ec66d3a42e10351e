"""Kimi K2.5's model: the DeepSeek-V3 decoder (models/deepseek_v3/model.py) with MoonViT
(``vision_tower``, its projector inside) in front. The image tokens replace the placeholders'
embeddings (MediaEmbedding, models/components/multimodal.py); positions stay 1-D and there are
no DeepStack tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchloom.models.components.moonvit import MoonViT
from torchloom.models.components.multimodal import MediaEmbedding
from torchloom.models.deepseek_v3.model import DeepSeekV3

if TYPE_CHECKING:  # the config builds this model: the model needs its type only
    from torchloom.models.kimi_k25.config import KimiK25Config


class KimiK25(MediaEmbedding, DeepSeekV3):
    """DeepSeekV3 reading images: ``media`` (MEDIA_KEYS) by keyword; None or empty runs the
    text model. A pipeline stage without ``embed_tokens`` has no ``vision_tower``."""

    media_encoder_name = "vision_tower"

    def __init__(self, cfg: KimiK25Config) -> None:
        super().__init__(cfg)
        self.vision_tower: MoonViT | None = MoonViT(cfg.vision)
