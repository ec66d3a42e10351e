"""Generation with images on qwen3_vl's debug model (random weights): greedy tokens equal the
argmax of full forwards without a cache on the growing sequence (whose M-RoPE positions the
model computes from the images), in the gathered and the static (CUDA-graph-shaped) decode,
alone, batched with a text request and admitted while another request decodes; requests
whose images do not fit their prompt fail alone."""

import json

import pytest
import torch

from torchloom.generate.engine import Generator, Request, SamplingParams, score
from torchloom.generate.graphs import DecodeGraphs
from torchloom.models import ModelConfig, build_model, resolve_model_config

CONFIG = resolve_model_config(ModelConfig(name="qwen3_vl", flavor="debug"))
START, END, IMAGE = (CONFIG.vision_start_token_id, CONFIG.vision_end_token_id,
                     CONFIG.image_token_id)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    model = build_model(CONFIG)
    model.init_weights(0)
    return model.eval()


def image_prompt(seed: int, grids: list[tuple[int, int, int]]) -> tuple[list[int], dict]:
    """Text, then each image's placeholder run with text between; random pixels."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 4000, (3,), generator=generator).tolist()
    for t, h, w in grids:
        prompt += [START] + [IMAGE] * (t * h * w // 4) + [END, 17, 23]
    L, P = max(t * h * w for t, h, w in grids), CONFIG.vision.patch_dim
    pixels = torch.zeros(len(grids), L, P)
    for n, (t, h, w) in enumerate(grids):
        pixels[n, : t * h * w] = torch.randn(t * h * w, P, generator=generator)
    return prompt, {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}


def reference(model, prompt: list[int], media: dict | None, steps: int) -> list[int]:
    """Greedy tokens from full forwards (no cache) on the growing sequence."""
    tokens = list(prompt)
    batch = None if media is None else {k: v[None] for k, v in media.items()}
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens], device=next(model.parameters()).device),
                           media=batch)  # fmt: skip
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.mark.parametrize("decode", ["gathered", "static"])
def test_greedy_with_images_equals_full_forwards(model, decode) -> None:
    with_two, media_two = image_prompt(0, [(1, 4, 4), (1, 2, 6)])
    with_one, media_one = image_prompt(1, [(1, 6, 2)])
    text = [11, 12, 13, 14, 15]
    generator = Generator(model, max_batch=3, max_len=64)
    if decode == "static":
        generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
    requests = [Request(with_two, GREEDY, media=media_two), Request(text, GREEDY),
                Request(with_one, GREEDY, media=media_one)]  # fmt: skip
    completions = generator.generate(requests)
    for request, completion in zip(requests, completions, strict=True):
        expected = reference(model, request.prompt_ids, request.media, GREEDY.max_new_tokens)
        assert completion.tokens == expected, (completion.tokens, expected)
    # The prompt's M-RoPE positions end below its length: decode positions are shifted.
    assert generator.cache.rope_delta_S.tolist()[0] < 0


def test_an_image_request_admitted_while_another_decodes(model) -> None:
    """The second request's prefill also advances the first (one mixed forward); the slot
    the first one leaves is reused by a text request, whose offset is reset to 0."""
    first, media_first = image_prompt(2, [(1, 4, 4)])
    second, media_second = image_prompt(3, [(1, 2, 2), (1, 4, 2)])
    generator = Generator(model, max_batch=2, max_len=64)
    a = generator.submit(Request(first, GREEDY, media=media_first))
    generator.step()
    generator.step()
    b = generator.submit(Request(second, GREEDY, media=media_second))
    c = generator.submit(Request([30, 31, 32], GREEDY))
    done = {}
    while len(done) < 3:
        done.update(generator.step())
    assert done[a].tokens == reference(model, first, media_first, 6)
    assert done[b].tokens == reference(model, second, media_second, 6)
    assert done[c].tokens == reference(model, [30, 31, 32], None, 6)


def test_requests_whose_images_do_not_fit_fail_alone(model) -> None:
    prompt, media = image_prompt(4, [(1, 4, 4)])
    _, other = image_prompt(5, [(1, 2, 2)])
    generator = Generator(model, max_batch=2, max_len=64)
    bad = generator.generate([
        Request(prompt, GREEDY, media=other),  # 4 placeholders, 1 merged token
        Request(prompt, GREEDY),  # placeholders without images
        Request(prompt, GREEDY, media={"pixel_values": media["pixel_values"]}),
        Request(prompt, GREEDY, media=media),
    ])  # fmt: skip
    assert [c.finish_reason for c in bad] == ["error", "error", "error", "length"]
    assert "does not match its images" in bad[0].error
    assert "no images" in bad[1].error


def test_malformed_media_are_refused_at_submit(model) -> None:
    """Wrong types raise TypeError naming the key; wrong shapes, grids below one patch and nan
    pixels end the request alone with the reason, before any forward."""
    prompt, media = image_prompt(7, [(1, 4, 4)])
    pixels, grid = media["pixel_values"], media["image_grid_thw"]
    generator = Generator(model, max_batch=2, max_len=64)
    wrong_types = {
        r"\['pixel_values'\] must be a torch tensor \(numpy: torch.from_numpy\)":
            {**media, "pixel_values": pixels.numpy()},
        r"\['image_grid_thw'\] must be an integer tensor .* got torch.float32":
            {**media, "image_grid_thw": grid.float()},
        "Request.media must be a dict of tensors": [pixels, grid],
    }  # fmt: skip
    for message, bad in wrong_types.items():
        with pytest.raises(TypeError, match=message):
            generator.submit(Request(prompt, GREEDY, media=bad))
    assert generator.idle
    nan_pixels = torch.full_like(pixels, torch.nan)
    bad_values = {
        "image_grid_thw must hold each image's t, h, w in patches, all >= 1; got [[1, -4, -4]]":
            {**media, "image_grid_thw": torch.tensor([[1, -4, -4]])},
        "pixel_values must be [images, patches, patch values] (3 dims); got shape [1, 1, 16,":
            {**media, "pixel_values": pixels[None]},
        "image_grid_thw must be [images, 3], a row per image of pixel_values (1); got shape [3]":
            {**media, "image_grid_thw": grid[0]},
        "pixel_values hold nan or inf": {**media, "pixel_values": nan_pixels},
    }  # fmt: skip
    done = generator.generate([Request(prompt, GREEDY, media=m) for m in bad_values.values()])
    for message, completion in zip(bad_values, done, strict=True):
        assert completion.finish_reason == "error" and completion.error.startswith(message), (
            completion.error
        )


def test_a_text_model_refuses_images() -> None:
    text_model = build_model(resolve_model_config(ModelConfig(name="qwen3", flavor="debug")))
    text_model.init_weights(0)
    _, media = image_prompt(6, [(1, 2, 2)])
    [completion] = Generator(text_model.eval(), max_batch=1, max_len=64).generate(
        [Request([1, 2, 3], GREEDY, media=media)]
    )
    assert completion.error == "this model reads no images"


def test_cli_generates_with_images(tmp_path, capsys) -> None:
    """`torchloom generate --image` and a prompts file of chats with image parts (paths
    relative to the file) on a saved qwen3_vl model with the builtin VL tokenizer: the same
    greedy tokens for the same picture and question."""
    from PIL import Image

    from torchloom.checkpoint.model_io import save_model
    from torchloom.cli import main
    from torchloom.data.build import build_tokenizer
    from torchloom.data.config import DataConfig
    from torchloom.recipes.vision import builtin_vl_token_overrides

    config = resolve_model_config(ModelConfig(
        name="qwen3_vl", flavor="debug", overrides={**builtin_vl_token_overrides(), "vision.patch_size": 16}
    ))  # fmt: skip
    model = build_model(config)
    model.init_weights(0)
    tokenizer = build_tokenizer(DataConfig(format="multimodal", tokenizer="builtin:stdlib_bpe_vl",
                                           sources=["builtin:shapes_chat"]))  # fmt: skip
    save_model(model, "qwen3_vl", config, tmp_path / "model", tokenizer=tokenizer)
    (tmp_path / "img").mkdir()
    Image.new("RGB", (24, 40), (200, 30, 30)).save(tmp_path / "img" / "red.png")
    line = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "path": "img/red.png"},
                    {"type": "text", "text": "What colour?"},
                ],
            }
        ]
    }
    (tmp_path / "prompts.jsonl").write_text(json.dumps(line) + "\n")
    common = ["generate", "--checkpoint", str(tmp_path / "model"), "--chat", "--greedy",
              "--max-new-tokens", "5", "--device", "cpu"]  # fmt: skip
    assert main([*common, "--prompts-file", str(tmp_path / "prompts.jsonl"),
                 "--output", str(tmp_path / "a.jsonl")]) == 0  # fmt: skip
    assert main([*common, "--prompt", "What colour?", "--image", str(tmp_path / "img" / "red.png"),
                 "--output", str(tmp_path / "b.jsonl")]) == 0  # fmt: skip
    a, b = (json.loads((tmp_path / f"{n}.jsonl").read_text()) for n in "ab")
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) >= 1
    assert a["prompt_ids"].count(config.image_token_id) >= 1


def test_a_missing_image_is_named_as_the_shells_path(tmp_path) -> None:
    """`--image` paths are the shell's, not a JSONL's: a missing file or a folder is refused
    before any model is loaded, naming the option and the current folder."""
    from torchloom.config.errors import ConfigError
    from torchloom.generate.run import read_prompts

    for image, what in ((tmp_path / "nope.png", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(ConfigError, match=f"--image {image} {what}") as caught:
            read_prompts(["What colour?"], None, chat=True, images=[str(image)])
        assert "current folder" in str(caught.value) and "JSONL" not in str(caught.value)


@pytest.mark.gpu
def test_greedy_with_images_on_the_gpu_with_captured_decode(model) -> None:
    """The same on a CUDA device, with the decode steps replayed from captured CUDA graphs (the
    default there): the M-RoPE offset lives in the cache, so the captured step stays generic."""
    gpu = build_model(CONFIG).to("cuda")
    gpu.load_state_dict(model.state_dict())
    gpu.eval()
    prompt, media = image_prompt(2, [(1, 4, 4), (1, 2, 6)])
    generator = Generator(gpu, max_batch=2, max_len=64)
    assert generator.graphs is not None
    request = Request(prompt, GREEDY, media={k: v.cuda() for k, v in media.items()})
    [completion] = generator.generate([request])
    assert completion.tokens == reference(gpu, prompt, request.media, GREEDY.max_new_tokens)


@pytest.mark.parametrize("family", ["kimi_k25", "muse_glimmer", "muse_spark"])
@pytest.mark.parametrize("decode", ["gathered", "static"])
def test_one_dimensional_families_generate_with_images(family, decode) -> None:
    """Kimi K2.5 and the Muse families (1-D positions, their own encoders) through the same
    engine: greedy tokens equal full forwards, beside a text request."""
    config = resolve_model_config(ModelConfig(name=family, flavor="debug"))
    model = build_model(config)
    model.init_weights(0)
    model.eval()
    vision = config.vision
    values = vision.patch_values if hasattr(vision, "patch_values") else vision.patch_dim
    generator = torch.Generator().manual_seed(3)
    requests = []
    for grids in ([(1, 4, 4), (1, 2, 6)], [(1, 6, 2)]):
        counts = model.media_encoder.merged_counts(torch.tensor([grids]))[0].tolist()
        prompt = torch.randint(5, 4000, (3,), generator=generator).tolist()
        for count in counts:
            prompt += [config.image_token_id] * count + [17, 23]
        places = -(-max(t * h * w for t, h, w in grids) // 4) * 4  # whole merge windows
        pixels = torch.zeros(len(grids), places, values)
        for n, (t, h, w) in enumerate(grids):
            pixels[n, : t * h * w] = torch.randn(t * h * w, values, generator=generator)
        media = {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}
        requests.append(Request(prompt, GREEDY, media=media))
    requests.insert(1, Request([11, 12, 13, 14, 15], GREEDY))
    engine = Generator(model, max_batch=3, max_len=64)
    if decode == "static":
        engine.graphs = DecodeGraphs(model, engine.cache, score, capture=False)
    completions = engine.generate(requests)
    for request, completion in zip(requests, completions, strict=True):
        expected = reference(model, request.prompt_ids, request.media, GREEDY.max_new_tokens)
        assert completion.tokens == expected, (family, completion.tokens, expected)
