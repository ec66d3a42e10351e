"""Muse Glimmer's model: the text decoder (models/muse_glimmer/config.py) with the vision encoder
(``vision_tower``, its adapter and projection inside; models/components/muse_vision.py) in
front; Muse Spark's adds the audio encoder (``audio_tower``, models/components/audio.py).

The image and audio tokens replace the placeholders' rows after the weightless embedding norm,
as transformers does (the encoders end with their own scale-free RMSNorm). Positions stay 1-D
and there are no DeepStack tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchloom.models.components.audio import MuseAudioEncoder
from torchloom.models.components.decoder import Decoder
from torchloom.models.components.multimodal import MediaEmbedding
from torchloom.models.components.muse_vision import MuseVisionEncoder

if TYPE_CHECKING:  # the configs build these models: the models need their types only
    from torchloom.models.muse_glimmer.config import MuseGlimmerConfig
    from torchloom.models.muse_spark.config import MuseSparkConfig


class MuseGlimmer(MediaEmbedding, Decoder):
    """The Muse decoder reading images: ``media`` (MEDIA_KEYS) by keyword; None or empty runs
    the text model. A pipeline stage without ``embed_tokens`` has no ``vision_tower``."""

    media_encoder_name = "vision_tower"

    def __init__(self, cfg: MuseGlimmerConfig) -> None:
        super().__init__(cfg)
        self.vision_tower: MuseVisionEncoder | None = MuseVisionEncoder(cfg.vision)


class MuseSpark(MuseGlimmer):
    """MuseGlimmer hearing audio too: ``media`` may add AUDIO_KEYS (``audio_tower``)."""

    audio_encoder_name = "audio_tower"

    def __init__(self, cfg: MuseSparkConfig) -> None:
        super().__init__(cfg)
        self.audio_tower: MuseAudioEncoder | None = MuseAudioEncoder(cfg.audio)
