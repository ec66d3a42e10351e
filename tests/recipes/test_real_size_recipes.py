"""The real-size pre-training recipes (torchloom/recipes/real_size.py) dry-run under their own
layouts on the CPU, one process simulating every rank: the model is the published size, the
layout's degrees multiply to its world size, and each GPU's bytes fit the GPU the recipe names
(and are the ones its docstring states)."""

import math
import re

import pytest
import torch

from tests.train.test_dry_run import per_rank
from torchloom.cli import main, resolve_job
from torchloom.models import build_model, resolve_model_config
from torchloom.recipes import get_recipe

GiB = 2**30

# recipe -> (GPUs of its layout, published parameters, memory of the GPU it names in GiB)
RECIPES = {
    "llama3_8b": (8, 8.03e9, 80),  # meta-llama/Llama-3.1-8B
    "llama3_70b": (32, 70.55e9, 80),  # meta-llama/Llama-3.1-70B
    "qwen3_30b_a3b": (16, 30.5e9, 80),  # Qwen/Qwen3-30B-A3B
    "deepseek_v3_16b": (8, 15.7e9, 80),  # deepseek-ai/DeepSeek-V2-Lite
    "deepseek_v3_671b": (256, 671e9, 80),  # deepseek-ai/DeepSeek-V3, without its MTP module
}


def mtp_params(job) -> int:
    """Parameters of the multi-token-prediction depths, which the published count leaves out."""
    with torch.device("meta"):
        model = build_model(resolve_model_config(job.model))
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp."))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_dry_runs_under_its_layout(name, capsys):
    world, published, gpu_gib = RECIPES[name]
    _, job = resolve_job(["--recipe", name])
    degrees = job.parallel.resolve(world)
    dims = [degrees.dp_replicate, degrees.dp_shard, degrees.cp, degrees.tp, degrees.pp]
    assert math.prod(dims) == world, f"{name}: degrees {dims} multiply to {math.prod(dims)}"
    assert degrees.dp_shard == job.parallel.dp_shard, "the layout names every degree"
    assert (degrees.dp_shard * degrees.cp) % degrees.ep == 0

    assert main(["train", "--recipe", name, "--dry-run", "--world-size", str(world)]) == 0
    out = capsys.readouterr().out
    print(out)
    # The data and tokenizer are placeholders that do not exist here: the dry run reads neither.
    assert "a dry run loads no data" in out
    head = out.splitlines()[0]
    assert f"on {world} simulated rank(s)" in head, head
    count = int(re.search(r"\((\d+) bytes, float32\)", head).group(1)) // 4
    main_count = count - mtp_params(job)
    print(f"{name}: {count / 1e9:.2f}B parameters, {main_count / 1e9:.2f}B without MTP")
    assert abs(main_count / published - 1) < 0.02, (main_count, published)

    rows = per_rank(out)
    assert len(rows) == degrees.pp  # one simulated rank per pipeline stage
    # Only layouts with tp, cp or pp go without the activation estimate.
    has_estimate = max(degrees.tp, degrees.cp, degrees.pp) == 1
    assert all((r["activations"] is not None) == has_estimate for r in rows.values())
    static = max(r["total"] for r in rows.values())
    bound = None
    if not has_estimate:
        # Bound a tp rank's activations by the same micro-batch's without tp (tp keeps 1/tp of
        # each block's input and of the logits).
        assert degrees.cp == degrees.pp == 1, "no bound for cp or pp layouts"
        flat = ["--parallel.tp", "1", "--parallel.dp_shard", str(world)]
        argv = ["train", "--recipe", name, *flat, "--dry-run", "--world-size", str(world)]
        assert main(argv) == 0
        flat_out = capsys.readouterr().out
        flat_out = flat_out[flat_out.rindex("dry run:") :]  # after the report printed above
        print(flat_out)
        bound = per_rank(flat_out)[0]["activations"]
    worst = max(r["total"] + (r["activations"] or bound) for r in rows.values())
    print(f"{name}: largest per-GPU bytes {worst / GiB:.2f} GiB of {gpu_gib} GiB")
    assert worst < gpu_gib * GiB

    # The docstring states what the dry run reports.
    doc = " ".join(get_recipe(name).build.__doc__.split())
    assert f"{static / GiB:.2f} GiB" in doc, (name, static / GiB)
    if has_estimate:
        assert f"{worst / GiB:.2f} GiB with the activation estimate" in doc, worst / GiB
    else:
        assert f"keeps {bound / GiB:.2f} GiB" in doc and f"at most {worst / GiB:.2f} GiB" in doc


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_points_at_parquet_shards_and_a_tokenizer_folder(name):
    _, job = resolve_job(["--recipe", name])
    assert job.data.sources == ["data/fineweb_edu"] and job.data.text_field == "text"
    assert job.data.tokenizer.startswith("tokenizers/")
    assert job.parallel.mixed_precision_param == "bf16" and job.compile.enabled
