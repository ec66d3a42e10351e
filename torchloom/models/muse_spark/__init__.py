"""Muse Spark family (registered as 'muse_spark'): Muse Glimmer's text decoder with per-head
output norms, learned residual gates and latent-width mixtures of experts, reading images and
audio (models/components/muse_vision.py, audio.py; models/muse_glimmer/model.py)."""

from torchloom.models.muse_glimmer import muse_tp_plan
from torchloom.models.muse_spark.config import MUSE_SPARK_FLAVORS, MuseSparkConfig
from torchloom.models.muse_spark.hf_adapter import MuseSparkHFAdapter
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="muse_spark",
        config_cls=MuseSparkConfig,
        flavors=MUSE_SPARK_FLAVORS,
        hf_adapter=MuseSparkHFAdapter(),
        tp_plan=muse_tp_plan,
        description="Muse Spark (Glimmer's with residual gates and latent-width MoE) reading "
        "images and audio",
    )
)

__all__ = ["MUSE_SPARK_FLAVORS", "MuseSparkConfig", "MuseSparkHFAdapter"]
