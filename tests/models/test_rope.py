"""RoPE: rotation layout, Llama 3 and YaRN frequencies against transformers and by hand."""

from __future__ import annotations

import math

import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.rope import (
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    inverse_frequencies,
)

HEAD_DIM = 16


def test_default_frequencies_follow_the_paper() -> None:
    inv_freq, scale = inverse_frequencies(RopeConfig(theta=10000.0), HEAD_DIM)
    expected = torch.tensor([10000.0 ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)])
    torch.testing.assert_close(inv_freq, expected)
    assert scale == 1.0


def test_rotation_matches_explicit_pair_rotations() -> None:
    """Channel i turns with channel i + d/2 by angle position * inv_freq[i]."""
    cfg = RopeConfig(theta=500.0)
    x_BTHd = torch.randn(2, 5, 3, HEAD_DIM, dtype=torch.float64)
    positions_BT = torch.tensor([[0, 1, 2, 3, 4], [7, 0, 1, 2, 30]])
    cos, sin = RotaryEmbedding(cfg, HEAD_DIM)(positions_BT)
    got = apply_rotary(x_BTHd, cos, sin)

    inv_freq, _ = inverse_frequencies(cfg, HEAD_DIM)
    expected = torch.empty_like(x_BTHd)
    half = HEAD_DIM // 2
    for b in range(2):
        for t in range(5):
            for i in range(half):
                angle = positions_BT[b, t].item() * inv_freq[i].item()
                rotation = torch.tensor(
                    [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]],
                    dtype=torch.float64,
                )
                pair_H2 = torch.stack([x_BTHd[b, t, :, i], x_BTHd[b, t, :, i + half]], dim=-1)
                rotated_H2 = pair_H2 @ rotation.T
                expected[b, t, :, i], expected[b, t, :, i + half] = rotated_H2.unbind(-1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_scores_depend_only_on_relative_position() -> None:
    rope = RotaryEmbedding(RopeConfig(), HEAD_DIM)
    q, k = torch.randn(1, 1, 1, HEAD_DIM), torch.randn(1, 1, 1, HEAD_DIM)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        cos, sin = rope(torch.tensor([[q_pos, k_pos]]))
        q_rot = apply_rotary(q, cos[:, :1], sin[:, :1])
        k_rot = apply_rotary(k, cos[:, 1:], sin[:, 1:])
        return (q_rot * k_rot).sum()

    torch.testing.assert_close(score(5, 2), score(103, 100), atol=1e-5, rtol=1e-5)


def test_cos_sin_follow_positions_and_are_fp32() -> None:
    cos, sin = RotaryEmbedding(RopeConfig(), HEAD_DIM)(torch.tensor([[0, 1, 2, 0, 1]]))
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (1, 5, HEAD_DIM)
    torch.testing.assert_close(cos[0, 3:], cos[0, :2], atol=0, rtol=0)
    torch.testing.assert_close(cos[0, 0], torch.ones(HEAD_DIM))


def _llama3_by_hand(cfg: RopeConfig, head_dim: int) -> torch.Tensor:
    """The Llama 3.1 rule per frequency, in float64."""
    out = []
    low_wavelen = cfg.original_max_seq_len / cfg.low_freq_factor
    high_wavelen = cfg.original_max_seq_len / cfg.high_freq_factor
    for i in range(head_dim // 2):
        freq = cfg.theta ** (-2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / cfg.factor)
        else:
            smooth = (cfg.original_max_seq_len / wavelen - cfg.low_freq_factor) / (
                cfg.high_freq_factor - cfg.low_freq_factor
            )
            out.append((1 - smooth) * freq / cfg.factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


LLAMA3_CASES = [
    RopeConfig(theta=500000.0, scaling="llama3", factor=8.0),  # Llama 3.1
    RopeConfig(theta=500000.0, scaling="llama3", factor=32.0),  # Llama 3.2
    RopeConfig(theta=10000.0, scaling="llama3", factor=4.0, low_freq_factor=2.0,
               high_freq_factor=8.0, original_max_seq_len=256),
]  # fmt: skip


@pytest.mark.parametrize("cfg", LLAMA3_CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_frequencies_match_transformers_and_formula(cfg: RopeConfig, head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    hf_config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": cfg.theta,
            "factor": cfg.factor,
            "low_freq_factor": cfg.low_freq_factor,
            "high_freq_factor": cfg.high_freq_factor,
            "original_max_position_embeddings": cfg.original_max_seq_len,
        },
    )
    expected, expected_scale = _compute_llama3_parameters(hf_config)
    got, scale = inverse_frequencies(cfg, head_dim)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert scale == expected_scale == 1.0
    torch.testing.assert_close(got.double(), _llama3_by_hand(cfg, head_dim), atol=0, rtol=1e-6)


def _yarn_by_hand(cfg: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, sec. 3.2-3.4) per frequency, in float64."""

    def pair_for(rotations: float) -> float:
        wavelen = cfg.original_max_seq_len / rotations  # this many turns over the old context
        return head_dim / 2 * math.log(wavelen / (2 * math.pi)) / math.log(cfg.theta)

    low, high = pair_for(cfg.beta_fast), pair_for(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    out = []
    for i in range(head_dim // 2):
        freq = cfg.theta ** (-2 * i / head_dim)
        interpolated_share = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(freq / cfg.factor * interpolated_share + freq * (1 - interpolated_share))

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(cfg.factor) + 1.0

    if cfg.attention_factor is not None:
        attention = cfg.attention_factor
    elif cfg.mscale_all_dim:
        attention = mscale(cfg.mscale) / mscale(cfg.mscale_all_dim)
    else:
        attention = mscale(1.0)
    return torch.tensor(out, dtype=torch.float64), attention


YARN_CASES = [
    RopeConfig(theta=10000.0, scaling="yarn", factor=4.0, original_max_seq_len=4096),
    RopeConfig(theta=1000000.0, scaling="yarn", factor=4.0, original_max_seq_len=32768),
    RopeConfig(theta=10000.0, scaling="yarn", factor=40.0, original_max_seq_len=4096,
               mscale=1.0, mscale_all_dim=0.707, truncate=False),
    RopeConfig(theta=50000.0, scaling="yarn", factor=8.0, original_max_seq_len=2048,
               beta_fast=16.0, beta_slow=2.0, attention_factor=1.25),
]  # fmt: skip


@pytest.mark.parametrize("cfg", YARN_CASES)
def test_yarn_frequencies_match_transformers_and_formula(cfg: RopeConfig) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    head_dim = 64
    rope_parameters: dict[str, object] = {
        "rope_type": "yarn",
        "rope_theta": cfg.theta,
        "factor": cfg.factor,
        "original_max_position_embeddings": cfg.original_max_seq_len,
        "beta_fast": cfg.beta_fast,
        "beta_slow": cfg.beta_slow,
        "truncate": cfg.truncate,
    }
    if cfg.mscale_all_dim:
        rope_parameters |= {"mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}
    if cfg.attention_factor is not None:
        rope_parameters["attention_factor"] = cfg.attention_factor
    hf_config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=int(cfg.original_max_seq_len * cfg.factor),
        rope_parameters=rope_parameters,
    )
    expected, expected_scale = _compute_yarn_parameters(hf_config)
    got, scale = inverse_frequencies(cfg, head_dim)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert scale == pytest.approx(expected_scale, rel=1e-12)

    by_hand, by_hand_scale = _yarn_by_hand(cfg, head_dim)
    torch.testing.assert_close(got.double(), by_hand, atol=0, rtol=1e-5)
    assert scale == pytest.approx(by_hand_scale, rel=1e-12)


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    cfg = RopeConfig(scaling="yarn", factor=16.0, original_max_seq_len=64)
    cos, sin = RotaryEmbedding(cfg, HEAD_DIM)(torch.arange(8)[None])
    expected = 0.1 * math.log(16.0) + 1.0
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, expected**2))


def test_validate_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'llama3'"):
        RopeConfig(scaling="llama").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="low_freq_factor"):
        RopeConfig(scaling="llama3", low_freq_factor=4.0, high_freq_factor=4.0).validate()
    with pytest.raises(ConfigError, match="positive"):
        RopeConfig(theta=0.0).validate()
