"""Vision-language (and audio) recipes: SFT of the tiny flavors of every family that reads media
on the builtin picture chats (and tone chats for Muse Spark), small enough for a CPU."""

from __future__ import annotations

from torchloom.config import register_recipe
from torchloom.data.config import BUILTIN_SHAPES_CHAT, BUILTIN_TONES_CHAT, DataConfig
from torchloom.data.media_layout import builtin_media_ids, media_layout
from torchloom.data.tokenizer import (
    IMAGE_TOKEN,
    MEDIA_SPECIAL_TOKENS,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
)
from torchloom.models.config import ModelConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig

TEXT_VOCAB = 4096
"""The builtin tokenizer's text vocabulary; builtin:stdlib_bpe_vl appends its media tokens."""


def model_vocab(text_vocab: int = TEXT_VOCAB) -> int:
    """The recipes' model vocabulary: builtin:stdlib_bpe_vl's ids (text + media) padded to a
    multiple of 8, so that tensor parallelism, which splits the embedding and the head by
    vocabulary rows, takes tp 2, 4 or 8 (4103 -> 4104)."""
    return -(-(text_vocab + len(MEDIA_SPECIAL_TOKENS)) // 8) * 8


def builtin_vl_token_overrides(text_vocab: int = TEXT_VOCAB) -> dict[str, int]:
    """A Qwen3-VL config's vocabulary and vision token ids as builtin:stdlib_bpe_vl gives them
    (its media tokens follow the text ids in MEDIA_SPECIAL_TOKENS' order)."""
    ids = {token: text_vocab + i for i, token in enumerate(MEDIA_SPECIAL_TOKENS)}
    return {
        "vocab_size": model_vocab(text_vocab),
        "image_token_id": ids[IMAGE_TOKEN],
        "vision_start_token_id": ids[VISION_START_TOKEN],
        "vision_end_token_id": ids[VISION_END_TOKEN],
        "video_token_id": ids["<|video_pad|>"],
    }


@register_recipe("qwen3_vl_debug")
def qwen3_vl_debug() -> JobConfig:
    """qwen3_vl's debug flavor (3 decoder layers, a 2-block ViT with DeepStack) fine-tuned on
    builtin:shapes_chat (colour, count and shape questions about drawn pictures), images of
    at most 64 patches of 16 pixels: a few minutes on a CPU."""
    return JobConfig(
        model=ModelConfig(
            name="qwen3_vl",
            flavor="debug",
            # The data's patches are Qwen3-VL's 16-pixel ones (the flavor's ViT reads 4).
            overrides={**builtin_vl_token_overrides(), "vision.patch_size": 16},
        ),
        data=DataConfig(
            format="multimodal",
            sources=[BUILTIN_SHAPES_CHAT],
            tokenizer="builtin:stdlib_bpe_vl",
            vocab_size=TEXT_VOCAB,
            max_images_per_row=4,
            max_image_patches=64,
            image_min_pixels=64 * 64,
        ),
        training=TrainingConfig(
            steps=200,
            seq_len=256,
            global_batch_size=8,
            val_interval=50,
            val_sequences=16,
            sample_tokens=0,
        ),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay="cosine"),
        output=OutputConfig(dir="outputs/qwen3_vl_debug"),
    )


@register_recipe("qwen3_vl_moe_debug")
def qwen3_vl_moe_debug() -> JobConfig:
    """qwen3_vl_debug with the debug_moe decoder (8 experts, top-2, in every layer)."""
    job = qwen3_vl_debug()
    job.model.flavor = "debug_moe"
    job.output.dir = "outputs/qwen3_vl_moe_debug"
    return job


@register_recipe("kimi_k25_debug")
def kimi_k25_debug() -> JobConfig:
    """kimi_k25's debug flavor (deepseek_v3's debug decoder, a 2-layer MoonViT) fine-tuned on
    builtin:shapes_chat with Kimi K2.5's media layout (raster-order 14-pixel patches, plain 1-D
    positions), spelled with builtin:stdlib_bpe_vl's tokens: a few minutes on a CPU."""
    job = qwen3_vl_debug()
    ids = builtin_media_ids(media_layout("kimi_k25"), TEXT_VOCAB)
    job.model = ModelConfig(
        name="kimi_k25",
        flavor="debug",
        overrides={
            "vocab_size": model_vocab(),
            "image_token_id": ids["image_token_id"],
            "vision_start_token_id": ids["image_start_token_id"],
            "vision_end_token_id": ids["image_end_token_id"],
            "vision.patch_size": 14,  # the data's Kimi patches
        },
    )
    job.data.media_layout = "kimi_k25"
    job.data.image_min_pixels = 0  # Kimi's processor sizes images by max_image_patches
    job.output.dir = "outputs/kimi_k25_debug"
    return job


@register_recipe("muse_glimmer_debug")
def muse_glimmer_debug() -> JobConfig:
    """muse_glimmer's debug flavor (sliding and global gated attention, sandwich norms, a
    2-layer ViT) fine-tuned on builtin:shapes_chat with Muse's media layout (two-frame 14-pixel
    patches, 1-D positions), spelled with builtin:stdlib_bpe_vl's tokens: minutes on a CPU."""
    return _muse_job("muse_glimmer", {})


@register_recipe("muse_spark_debug")
def muse_spark_debug() -> JobConfig:
    """muse_spark's debug flavor (muse_glimmer_debug's decoder with residual gates and a latent
    MoE, plus the audio encoder, here folding Muse Spark's 1920 samples into a token) on
    builtin:shapes_chat and builtin:tones_chat (which of two tones is higher or longer)."""
    ids = builtin_media_ids(media_layout("muse_spark"), TEXT_VOCAB)
    job = _muse_job("muse_spark", {"audio_token_id": ids["audio_token_id"],
                                   "audio.patch_sizes": [40, 48]})  # fmt: skip
    job.data.sources = [BUILTIN_SHAPES_CHAT, BUILTIN_TONES_CHAT]
    return job


def _muse_job(family: str, overrides: dict) -> JobConfig:
    """qwen3_vl_debug's data and schedule for a Muse family's debug flavor."""
    job = qwen3_vl_debug()
    ids = builtin_media_ids(media_layout(family), TEXT_VOCAB)
    job.model = ModelConfig(
        name=family,
        flavor="debug",
        overrides={
            "vocab_size": model_vocab(),
            "image_token_id": ids["image_token_id"],
            "vision.patch_size": 14,  # the data's Muse patches: 2 frames x 3 x 14 x 14
            "vision.temporal_patch": 2,
            **overrides,
        },
    )
    job.data.media_layout = family
    job.data.image_min_pixels = 0  # Muse's processor sizes images by max_image_patches
    # Muse's soft-capped (Spark: scaled) logits move slowly at qwen3_vl_debug's 3e-3: 12 steps
    # took the loss down 0.3-0.4 there, 1.9-2.1 here; 200 steps end at validation 0.16.
    job.optimizer.lr = 2e-2
    job.output.dir = f"outputs/{family}_debug"
    return job
