"""DeepSeek-V3.2 family (registered as 'deepseek_v32'): DeepSeek-V3 with DeepSeek sparse
attention (a lightning indexer choosing the keys of every query, trained by a KL loss)."""

from torchloom.models.deepseek_v3.parallelize import tp_plan
from torchloom.models.deepseek_v32.config import DEEPSEEK_V32_FLAVORS, DeepSeekV32Config
from torchloom.models.deepseek_v32.hf_adapter import DeepSeekV32HFAdapter
from torchloom.models.deepseek_v32.model import DeepSeekV32
from torchloom.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        name="deepseek_v32",
        config_cls=DeepSeekV32Config,
        flavors=DEEPSEEK_V32_FLAVORS,
        hf_adapter=DeepSeekV32HFAdapter(),
        tp_plan=tp_plan,  # deepseek_v3's: the layers' own plans, and the MTP depths
        description="DeepSeek-V3.2 decoder (DeepSeek-V3 with DeepSeek sparse attention: a "
        "lightning indexer picks the top-k keys of every query)",
    )
)

__all__ = ["DEEPSEEK_V32_FLAVORS", "DeepSeekV32", "DeepSeekV32Config", "DeepSeekV32HFAdapter"]
