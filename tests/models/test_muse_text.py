"""Muse Glimmer's and Muse Spark's text decoders: logits equal transformers' on a tiny random
checkpoint (text-only input, sequences longer than the sliding window), export round-trips,
the config round-trips, the published shapes' parameter counts, training, and greedy generation
equal to full forwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from torchloom.checkpoint.hf import hf_architecture, load_hf_weights, save_hf
from torchloom.cli import resolve_job
from torchloom.config import ConfigError
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.models import ModelConfig, build_model, get_model_spec, resolve_model_config
from torchloom.train.trainer import Trainer

WINDOW = 8
TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
    max_position_embeddings=128,
)  # fmt: skip
SPARK_TEXT = TEXT | dict(
    moe_intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, moe_hidden_size=40,
    mlp_layer_types=["sparse", "dense", "sparse", "sparse"], routed_scaling_factor=1.5,
)  # fmt: skip
VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
IDS = dict(image_token_id=250, video_token_id=251)  # within the vocabulary, not in TOKENS
HF = {
    "muse_glimmer": lambda: transformers.MuseGlimmerForConditionalGeneration(
        transformers.MuseGlimmerConfig(
            text_config=TEXT, vision_config=VISION, out_hidden_size=128, projector_hidden_size=32,
            **IDS,
        )
    ),
    "muse_spark": lambda: transformers.MuseSparkForConditionalGeneration(
        transformers.MuseSparkConfig(
            text_config=SPARK_TEXT, vision_config=VISION, out_hidden_size=128,
            projector_hidden_size=32,
            audio_config=dict(hidden_sizes=(8, 8, 8, 8), depths=(1, 1, 1, 1), out_hidden_size=64),
            audio_token_id=252, **IDS,
        )
    ),
}  # fmt: skip
FAMILIES = list(HF)


def tiny_hf(family: str) -> torch.nn.Module:
    """The transformers model with every weight random (the norms' offsets and the residual
    gates too, so a (1 + w) read as w would show) and the routers' correction bias random."""
    torch.manual_seed(0)
    model = HF[family]().float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and "inv_freq" not in name:
                tensor.normal_(0.0, 0.5 if "norm" in name or "residual_gate" in name else 0.1)
    return model


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    family = request.param
    hf = tiny_hf(family)
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return family, hf, path


def load_ours(path: Path) -> torch.nn.Module:
    _, config = hf_architecture(path)
    model = build_model(config)
    load_hf_weights(model, path)
    return model.eval()


TOKENS = torch.randint(0, 250, (2, 3 * WINDOW + 3), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers(checkpoint) -> None:
    family, hf, path = checkpoint
    model = load_ours(path)
    assert model.config.sliding_window == WINDOW and len(TOKENS[0]) > WINDOW
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(input_ids=TOKENS).logits
    diff = rel_diff(ours, theirs)
    print(f"{family}: max |ours - transformers| / max |transformers| = {diff:.1e}")
    assert diff < 1e-5, diff
    # The window matters: the same model with full attention everywhere differs.
    full = model.config.__class__(**{**vars(model.config), "sliding_window": 10_000})
    wide = build_model(full)
    wide.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel_diff(wide.eval()(TOKENS), theirs) > 1e-3


def test_export_round_trips(checkpoint, tmp_path) -> None:
    family, hf, path = checkpoint
    model = load_ours(path)
    save_hf(tmp_path / "out", family, model.config, model.state_dict().items())
    assert load_ours(tmp_path / "out").config == model.config
    with torch.no_grad():
        assert torch.equal(load_ours(tmp_path / "out")(TOKENS), model(TOKENS))
    # transformers reads the exported config and, under its names, the exported tensors.
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert type(exported) is type(hf.config)
    assert exported.text_config.layer_types == hf.config.text_config.layer_types
    reference = tiny_hf(family)
    reference.load_state_dict(_safetensors(tmp_path / "out"), strict=False)
    with torch.no_grad():
        assert rel_diff(model(TOKENS), reference(input_ids=TOKENS).logits) < 1e-5


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        tensors |= load_file(file)
    return tensors


def test_unknown_text_options_are_refused_by_name(checkpoint) -> None:
    family, _, path = checkpoint
    adapter = get_model_spec(family).hf_adapter
    hf = json.loads((path / "config.json").read_text())
    hf["text_config"]["attn_logit_softcapping"] = 50.0
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        adapter.config_from_hf(hf)
    hf["text_config"].pop("attn_logit_softcapping")
    hf["text_config"]["layer_rope_theta"] = [0, 1.0, 1.0, 0]
    with pytest.raises(ConfigError, match="layer_rope_theta"):
        adapter.config_from_hf(hf)


@pytest.mark.parametrize(
    ("family", "flavor", "hf_class", "hf_config"),
    [
        ("muse_glimmer", "30B", "MuseGlimmerForConditionalGeneration", "MuseGlimmerConfig"),
        ("muse_spark", "816B-A42B", "MuseSparkForConditionalGeneration", "MuseSparkConfig"),
    ],
)
def test_published_shapes_count_transformers_parameters(family, flavor, hf_class, hf_config):
    """The flavors are transformers' config defaults, encoders included; counted on the meta
    device."""
    cfg = get_model_spec(family).flavors[flavor]
    with torch.device("meta"):
        hf_cfg = getattr(transformers, hf_config)(
            **({"audio_config": {"out_hidden_size": cfg.dim}} if family == "muse_spark" else {})
        )
        model = getattr(transformers, hf_class)(hf_cfg)
    expected = sum(p.numel() for p in model.parameters())
    ours = cfg.num_params()
    print(f"{family} {flavor}: {ours:,} parameters")
    assert ours == expected
    adapter = get_model_spec(family).hf_adapter
    assert adapter.config_from_hf(hf_cfg.to_dict()) == cfg  # the published config reads as it


@pytest.mark.parametrize("family", FAMILIES)
def test_it_trains_and_declares_a_tensor_parallel_plan(family, tmp_path) -> None:
    """The plan's parity with one process: tests/parallel/test_muse_layouts.py."""
    _, job = resolve_job(["--recipe", "debug", "--model.name", family, "--training.steps", "4",
                          "--output.dir", str(tmp_path / "run"), "--metrics.tensorboard", "false",
                          "--training.sample_tokens", "0"])  # fmt: skip
    result = Trainer(job).train()
    assert result.last_loss < result.first_loss
    model = build_model(resolve_model_config(ModelConfig(name=family, flavor="debug")))
    plan = get_model_spec(family).tp_plan(model, 2)
    assert "layers.0.mlp_post_norm" in plan and "residual_entry" in plan


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_full_forwards(family) -> None:
    """Prompts longer than the debug flavor's window (16): the cache hides keys out of it."""
    model = build_model(resolve_model_config(ModelConfig(name=family, flavor="debug")))
    model.init_weights(0)
    model.eval()
    prompts = [list(range(5, 25)), list(range(40, 63)), [7, 8, 9]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    completions = Generator(model, max_batch=2, max_len=64).generate(
        [Request(p, params) for p in prompts]
    )
    for prompt, completion in zip(prompts, completions):
        sequence = list(prompt)
        for _ in range(8):
            with torch.no_grad():
                sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
        assert completion.tokens == sequence[len(prompt) :]
