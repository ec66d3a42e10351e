"""Kimi K2.5 family (registered as 'kimi_k25'): Kimi K2's DeepSeek-V3 decoder reading images
through MoonViT."""

from torchloom.models.kimi_k25.config import KIMI_K25_FLAVORS, KimiK25Config
from torchloom.models.kimi_k25.hf_adapter import KimiK25HFAdapter
from torchloom.models.kimi_k25.model import KimiK25
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="kimi_k25",
        config_cls=KimiK25Config,
        flavors=KIMI_K25_FLAVORS,
        hf_adapter=KimiK25HFAdapter(),
        tp_plan=None,  # the vision encoder has no tensor-parallel plan yet
        description="Kimi K2.5 (Kimi K2's DeepSeek-V3 decoder + MoonViT vision encoder and "
        "projector, 1-D positions)",
    )
)

__all__ = ["KIMI_K25_FLAVORS", "KimiK25", "KimiK25Config", "KimiK25HFAdapter"]
