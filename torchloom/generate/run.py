"""`torchloom generate`: load a model and its tokenizer, read prompts, write one JSON line per
request (in input order) with the generated ids, their log-probabilities and the text."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.generate.engine import Generator, Request, SamplingParams


def load_model_and_tokenizer(
    from_hf: str | None,
    checkpoint: str | None,
    device: torch.device,
    dtype: str | None,
    batch_invariant: bool = False,
    tp: int = 1,
) -> tuple[nn.Module, Any]:
    """(model in eval mode, Tokenizer or None) from a Hugging Face folder, a torchloom model
    folder, or one step of a training checkpoint; ``batch_invariant`` builds it in that mode;
    ``tp`` > 1 splits it over the ``tp`` ranks of the torchrun job (tensor parallelism)."""
    from torchloom.checkpoint.convert import open_model_source
    from torchloom.checkpoint.hf import hf_architecture, load_hf_weights
    from torchloom.checkpoint.safetensors_io import load_into, parse_dtype
    from torchloom.data.tokenizer import Tokenizer
    from torchloom.models import build_model, get_model_spec
    from torchloom.models.config import batch_invariant_config

    if from_hf:
        spec, config = hf_architecture(Path(from_hf))
        family, folder, source = spec.name, Path(from_hf), None
    else:
        source = open_model_source(Path(checkpoint))
        family, config, folder = source.family, source.config, source.tokenizer_dir
    if batch_invariant:
        config = batch_invariant_config(config)
    with torch.device("meta"):
        model = build_model(config, family)
    target = parse_dtype(dtype)
    if target is not None:
        model.to(target)
    model.to_empty(device=device)
    if source is None:
        load_hf_weights(model, Path(from_hf))
    else:
        load_into(model, source.tensors, str(checkpoint))
    if tp > 1:
        tensor_parallel(model, get_model_spec(family), tp, device)
    tokenizer = None
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(folder)
    return model.eval(), tokenizer


def tensor_parallel(model: nn.Module, spec: Any, tp: int, device: torch.device) -> None:
    """Split the loaded model's heads and hidden units over the job's ranks: the family's
    plan without sequence parallelism (a decode step has one token per sequence)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchloom.parallel.tensor_parallel import apply_tensor_parallel

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != tp:
        raise ConfigError(
            f"--tp {tp} needs {tp} processes (torchrun --nproc-per-node {tp} -m torchloom "
            f"generate ...); this job has {world}."
        )
    if spec.tp_plan is None:
        raise ConfigError(f"Model family '{spec.name}' declares no tensor-parallel plan.")
    if model.config.batch_invariant:
        raise ConfigError("--batch-invariant runs on whole-model ranks only; drop --tp.")
    mesh = init_device_mesh(device.type, (tp,))
    apply_tensor_parallel(model, mesh, spec.tp_plan(model, tp, False, sequence_parallel=False))


def read_prompts(prompts: list[str], prompts_file: str | None, tokenizer: Any) -> list[list[int]]:
    """Token ids of every prompt: ``--prompt`` texts, then the lines of ``--prompts-file``
    (objects with ``prompt`` text or ``prompt_ids``)."""
    texts: list[str | list[int]] = list(prompts)
    if prompts_file:
        for number, line in enumerate(Path(prompts_file).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{prompts_file} line {number} is not JSON ({err}).") from None
            if not isinstance(record, dict) or not ("prompt" in record or "prompt_ids" in record):
                raise ConfigError(
                    f'{prompts_file} line {number}: expected an object with "prompt" (text) '
                    'or "prompt_ids" (a list of token ids).'
                )
            texts.append(record["prompt_ids"] if "prompt_ids" in record else record["prompt"])
    if not texts:
        raise ConfigError("No prompts: pass --prompt TEXT (repeatable) or --prompts-file F.jsonl.")
    ids = []
    for item in texts:
        if isinstance(item, str):
            if tokenizer is None:
                raise ConfigError(
                    "Text prompts need a tokenizer, and the model folder has no tokenizer.json; "
                    "give prompt_ids in --prompts-file instead."
                )
            ids.append(tokenizer.encode(item))
        else:
            ids.append([int(t) for t in item])
    return ids


def generate_to_file(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    output: Path | None,
    max_batch: int,
    verbose: bool = True,
    compile: bool = False,
) -> list[dict[str, Any]]:
    """Run every prompt (request i gets seed + i when a seed is given) and write the records."""
    stop = params.stop_ids or ((tokenizer.eos_id,) if tokenizer is not None else ())
    requests = [
        Request(
            ids,
            replace(params, stop_ids=stop, seed=None if params.seed is None else params.seed + i),
        )
        for i, ids in enumerate(prompt_ids)
    ]
    # The cache holds the longest request, not the model's whole context.
    longest = max(len(ids) for ids in prompt_ids) + params.max_new_tokens
    max_len = min(longest, model.config.max_seq_len)
    generator = Generator(model, max_batch, max_len=max_len, compile=compile)
    start = time.perf_counter()
    completions = generator.generate(requests)
    seconds = time.perf_counter() - start
    records = []
    for i, (ids, completion) in enumerate(zip(prompt_ids, completions)):
        record: dict[str, Any] = {
            "index": i,
            "prompt_ids": ids,
            "tokens": completion.tokens,
            "logprobs": completion.logprobs,
            "finish_reason": completion.finish_reason,
        }
        if completion.error:
            record["error"] = completion.error
        if tokenizer is not None:
            record["text"] = tokenizer.decode(completion.tokens)
        records.append(record)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text("".join(json.dumps(r) + "\n" for r in records))
    generated = sum(len(c.tokens) for c in completions)
    if verbose:
        print(f"{len(requests)} request(s), {generated} tokens in {seconds:.2f} s "
              f"({generated / max(seconds, 1e-9):,.0f} tokens/s)")  # fmt: skip
    return records
