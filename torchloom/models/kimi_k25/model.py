"""Kimi K2.5's model: the DeepSeek-V3 decoder (models/deepseek_v3/model.py) with MoonViT
(``vision_tower``, its projector inside) in front. The image tokens replace the placeholders'
embeddings (MediaEmbedding, models/components/multimodal.py); positions stay 1-D and there are
no DeepStack tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchloom.models.components.cache import ModelCache
from torchloom.models.components.decoder import Objective
from torchloom.models.components.moonvit import MoonViT
from torchloom.models.components.multimodal import MediaEmbedding
from torchloom.models.components.param_init import ParamInit
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

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        *,
        cache: ModelCache | None = None,
        objective: Objective | None = None,
        targets: dict[str, torch.Tensor] | None = None,
        media: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        """DeepSeekV3.forward, its first block reading the image tokens at the placeholders."""
        embeds_BTD = None
        media = self.media_or_none(media)
        if media is not None:
            embeds_BTD, _ = self.embed_media(tokens_BT, self.embed(tokens_BT), media)
        return super().forward(
            tokens_BT, positions_BT, doc_ids_BT, cache=cache, objective=objective,
            targets=targets, embeds_BTD=embeds_BTD,
        )  # fmt: skip

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """MoonViT's init (biases zero, LayerNorms one), then the decoder's."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        if self.vision_tower is not None:
            self.vision_tower.init_weights(init)
        super().init_weights(init)
