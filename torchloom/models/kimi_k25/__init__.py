"""Kimi K2.5 family (registered as 'kimi_k25'): Kimi K2's DeepSeek-V3 decoder reading images
through MoonViT."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from torchloom.config.errors import ConfigError
from torchloom.models.components.vision_plan import media_entry_plan, moonvit_tp_plan
from torchloom.models.deepseek_v3.parallelize import tp_plan as deepseek_v3_tp_plan
from torchloom.models.kimi_k25.config import KIMI_K25_FLAVORS, KimiK25Config
from torchloom.models.kimi_k25.hf_adapter import KimiK25HFAdapter
from torchloom.models.kimi_k25.model import KimiK25
from torchloom.models.registry import ModelSpec, register_model


def tp_plan(
    model: KimiK25, tp: int, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """DeepSeek-V3's plan for the decoder, MoonViT's under ``vision_tower.`` (heads and hidden
    units split, components/vision_plan.py) and, under sequence parallelism, the image tokens
    scattered into the whole sequence before it is cut (``media_entry_plan``)."""
    if sequence_parallel and model.mtp is not None and model.embed_tokens is not None:
        raise ConfigError(
            f"--parallel.tp {tp}: kimi_k25 with multi-token prediction has no sequence-parallel "
            "plan (its depths read the embedding, which stays whole for the image tokens); set "
            "--model.overrides '{\"mtp_layers\": 0}' or --parallel.tp 1."
        )
    plan = deepseek_v3_tp_plan(model, tp, loss_parallel, sequence_parallel)
    if model.vision_tower is not None:
        encoder_plan = moonvit_tp_plan(model.vision_tower, tp)
        plan.update({"vision_tower." + path: style for path, style in encoder_plan.items()})
    if sequence_parallel:
        plan.update(media_entry_plan(model))
    return plan


register_model(
    ModelSpec(
        name="kimi_k25",
        config_cls=KimiK25Config,
        flavors=KIMI_K25_FLAVORS,
        hf_adapter=KimiK25HFAdapter(),
        tp_plan=tp_plan,
        description="Kimi K2.5 (Kimi K2's DeepSeek-V3 decoder + MoonViT vision encoder and "
        "projector, 1-D positions)",
    )
)

__all__ = ["KIMI_K25_FLAVORS", "KimiK25", "KimiK25Config", "KimiK25HFAdapter", "tp_plan"]
