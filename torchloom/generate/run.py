"""`torchloom generate`: load a model and its tokenizer, read and check prompts, write one JSON
line per request (in input order) with the generated ids, their log-probabilities and the text."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.paths import check_can_create
from torchloom.data.cache import atomic_write_text
from torchloom.data.chat import Message
from torchloom.data.conversations import ROLES
from torchloom.data.images import ImageProcessing, image_patches, load_image
from torchloom.data.multimodal import PREPROCESSOR_CONFIG
from torchloom.data.multimodal_format import MediaTokens, parse_prompt
from torchloom.data.sources import MESSAGES_FIELD, iter_jsonl_records
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.generate.requests import Completion, too_long


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
    ``tp`` > 1 splits it over the ``tp`` ranks of the torchrun job (tensor parallelism).

    Built on meta and split there, so each rank allocates and reads only its own shards (the
    loaders read the local box of every DTensor parameter); no rank holds the whole model."""
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
        source = open_model_source(Path(checkpoint), "--checkpoint")
        family, config, folder = source.family, source.config, source.tokenizer_dir
    if batch_invariant:
        config = batch_invariant_config(config)
    with torch.device("meta"):
        model = build_model(config)
    target = parse_dtype(dtype)
    if target is not None:
        model.to(target)
    if tp > 1:
        tensor_parallel(model, get_model_spec(family), tp, device)
    model.to_empty(device=device)
    if source is None:
        load_hf_weights(model, Path(from_hf))
    else:
        load_into(model, source.reader, source.name)
    tokenizer = None
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(folder)
    return model.eval(), tokenizer


def tensor_parallel(model: nn.Module, spec: Any, tp: int, device: torch.device) -> None:
    """Split the model's heads and hidden units over the job's ranks (on meta before its
    weights load, or a loaded model): the family's plan without sequence parallelism (a
    decode step has one token per sequence)."""
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


@dataclass(frozen=True)
class Prompt:
    """One prompt as given, before tokenization: text, token ids, or chat messages."""

    where: str
    """Where it came from (``--prompt #2``, ``file:line``), for error messages."""
    text: str | None = None
    ids: list[int] | None = None
    messages: list[Message] | None = None
    folder: Path | None = None
    """Where the messages' image paths are relative to (the prompts file's folder)."""

    @property
    def has_images(self) -> bool:
        return any(not isinstance(m["content"], str) for m in self.messages or [])


_PROMPT_KEYS = ("prompt", "prompt_ids", MESSAGES_FIELD)
_EXAMPLE = '{"prompt": "text"} or {"prompt_ids": [1, 2]}'


def read_prompts(
    prompts: list[str], prompts_file: str | None, chat: bool = False, images: list[str] = ()
) -> list[Prompt]:
    """Every prompt, checked before any model is loaded: the ``--prompt`` texts, then the lines
    of ``--prompts-file`` (``{"messages": [...]}`` lines only with ``chat``; their content may be
    a list of text and image parts, paths relative to the file). ``images`` (``--image``, with
    ``chat`` and one ``--prompt``) come before that prompt's text in one user message."""
    if images and (len(prompts) != 1 or not chat):
        raise ConfigError(
            "--image goes with exactly one --prompt TEXT and --chat (the images and the text "
            "form one user message); for more, use --prompts-file with image parts."
        )
    items = [Prompt(f"--prompt #{i}", text=text) for i, text in enumerate(prompts, 1)]
    for image in images:  # --image paths are the shell's (a JSONL's are relative to its folder)
        if not Path(image).is_file():
            what = "is a folder" if Path(image).is_dir() else "does not exist"
            raise ConfigError(
                f"--image {image} {what}: give the path of an image file, absolute or relative "
                f"to the current folder ({Path.cwd()})."
            )
    if images:
        parts = [{"type": "image", "path": str(Path(p).absolute())} for p in images]
        content = [*parts, {"type": "text", "text": prompts[0]}]
        items = [Prompt("--prompt #1", messages=[{"role": "user", "content": content}],
                        folder=Path.cwd())]  # fmt: skip
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {prompts_file} does not exist or is not a file.")
        records = iter_jsonl_records(path, _EXAMPLE)
        items += [replace(_parse_prompt(record, where, chat), folder=path.parent)
                  for where, record in records]  # fmt: skip
    if not items and prompts_file:
        raise ConfigError(
            f"--prompts-file {prompts_file} holds no prompts (only blank lines); put one JSON "
            f"object per line, such as {_EXAMPLE}."
        )
    if not items:
        raise ConfigError("No prompts: pass --prompt TEXT (repeatable) or --prompts-file F.jsonl.")
    return items


def _parse_prompt(record: Any, where: str, chat: bool) -> Prompt:
    unknown = [key for key in record if key not in _PROMPT_KEYS] if isinstance(record, dict) else []
    if unknown:
        # Sampling settings are the command's options, the same for every line.
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(json.dumps, unknown))}; a line holds exactly "
            f'one of "prompt", "prompt_ids" or "{MESSAGES_FIELD}" and nothing else (sampling '
            "settings are options: --max-new-tokens, --temperature, --top-k, --top-p, --seed)."
            f"{did_you_mean(unknown[0], _PROMPT_KEYS)}"
        )
    keys = [key for key in _PROMPT_KEYS if isinstance(record, dict) and key in record]
    if len(keys) != 1:
        raise ConfigError(
            f'{where}: expected an object with exactly one of "prompt" (text), "prompt_ids" '
            f'(token ids) or "{MESSAGES_FIELD}" (a chat, with --chat); got {_shown(record)}.'
        )
    value = record[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise ConfigError(
                f'{where}: "prompt" must be text (a string); got {_shown(value)}. Token ids go '
                'in "prompt_ids".'
            )
        return Prompt(where, text=value)
    if keys[0] == "prompt_ids":
        return Prompt(where, ids=_token_ids(value, where))
    if not chat:
        raise ConfigError(
            f'{where}: a "{MESSAGES_FIELD}" line is a chat for the model\'s chat template; add '
            "--chat to apply it."
        )
    return Prompt(where, messages=_messages(value, where))


def _token_ids(value: object, where: str) -> list[int]:
    """``value`` if it is a list of token ids (JSON integers >= 0; booleans are not ids)."""
    if not isinstance(value, list):
        raise ConfigError(
            f'{where}: "prompt_ids" must be a list of token ids; got {_shown(value)}.'
        )
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(
                f'{where}: "prompt_ids" must hold token ids (integers >= 0); item {i} is '
                f"{_shown(token)}."
            )
    return value


def _messages(value: object, where: str) -> list[Message]:
    """``value`` if it is a non-empty list of ``{"role", "content"}`` messages with known roles."""
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f'{where}: "{MESSAGES_FIELD}" must be a non-empty list of {{"role": ..., '
            f'"content": ...}} objects; got {_shown(value)}.'
        )
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str | list)
        ):
            raise ConfigError(
                f'{where}: message {i} must be an object with a "role" string and a "content" '
                f"string or list of parts; got {_shown(message)}."
            )
        if message["role"] not in ROLES:
            raise ConfigError(
                f"{where}: message {i} has role {message['role']!r}; roles are "
                f"{', '.join(ROLES)}.{did_you_mean(message['role'], ROLES)}"
            )
    return value


def _shown(value: object) -> str:
    """``value`` as JSON, cut short for an error line."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def encode_prompts(items: list[Prompt], tokenizer: Any, chat: bool = False) -> list[list[int]]:
    """Token ids of every prompt; with ``chat``, texts (each one user message) and messages go
    through the tokenizer's chat template with the assistant's reply opened."""
    if tokenizer is None and (chat or any(item.ids is None for item in items)):
        what = "--chat needs" if chat else "Text prompts need"
        raise ConfigError(
            f"{what} the model's tokenizer, and the model folder has no tokenizer.json; give "
            "prompt_ids in --prompts-file (without --chat) instead."
        )
    if chat and tokenizer.chat_template is None:
        raise ConfigError(
            f"--chat needs a chat template, and the tokenizer in {tokenizer.path} has none (no "
            "chat_template in tokenizer_config.json, no chat_template.jinja); drop --chat to "
            "give the prompts as plain text."
        )
    return [_encode(item, tokenizer, chat) for item in items]


def encode_image_prompts(
    items: list[Prompt], tokenizer: Any, model: nn.Module
) -> list[tuple[list[int], dict[str, torch.Tensor] | None]]:
    """(ids, media) of every prompt: ``encode_prompts``' ids, and for chats with image parts
    their images as patches the model's vision encoder reads (``image_processing``)."""
    if not any(item.has_images for item in items):
        return [(ids, None) for ids in encode_prompts(items, tokenizer, chat=True)]
    if getattr(model, "visual", None) is None:
        where = next(item.where for item in items if item.has_images)
        raise ConfigError(f"{where}: the prompt holds images but this model reads no images.")
    processing = image_processing(model.config, tokenizer)
    return [
        image_prompt(item.messages, item.where, item.folder or Path.cwd(), tokenizer, processing)
        if item.has_images
        else (_encode(item, tokenizer, chat=True), None)
        for item in items
    ]


def image_processing(config: Any, tokenizer: Any) -> ImageProcessing:
    """How ``generate`` turns images into patches: the tokenizer folder's
    preprocessor_config.json (a Hugging Face VL folder's), else Qwen3-VL's pixel bounds with the
    model's patch, frame and merge sizes."""
    folder = tokenizer.path if tokenizer.path.is_dir() else tokenizer.path.parent
    if (folder / PREPROCESSOR_CONFIG).is_file():
        return ImageProcessing.from_preprocessor_config(folder / PREPROCESSOR_CONFIG)
    vision = config.vision
    return ImageProcessing(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)


def _encode(item: Prompt, tokenizer: Any, chat: bool) -> list[int]:
    if item.ids is not None:
        return item.ids
    try:
        if item.messages is not None:
            return tokenizer.encode_chat_prompt(item.messages)
        return tokenizer.encode_prompt(item.text, chat)
    except ConfigError as err:  # the template refused this conversation
        raise ConfigError(f"{item.where}: {err}") from None


def image_prompt(
    messages: list[Any], where: str, folder: Path, tokenizer: Any, processing: ImageProcessing
) -> tuple[list[int], dict[str, torch.Tensor] | None]:
    """(prompt ids, Request media) of chat ``messages`` whose content may hold image parts (the
    multimodal JSONL's, paths relative to ``folder``), with the assistant's reply opened."""
    sample = parse_prompt(messages, where, folder, MediaTokens.from_tokenizer(tokenizer),
                          processing)  # fmt: skip
    ids = tokenizer.encode_chat_prompt(sample.conversation.messages)
    if not sample.images:
        return ids, None
    patches = [image_patches(load_image(i.path, where, processing), processing)[0]
               for i in sample.images]  # fmt: skip
    pixels_NLP = torch.zeros(len(patches), max(len(p) for p in patches), processing.patch_dim)
    for n, image in enumerate(patches):
        pixels_NLP[n, : len(image)] = torch.from_numpy(image)
    grids_N3 = torch.tensor([image.grid for image in sample.images])
    return ids, {"pixel_values": pixels_NLP, "image_grid_thw": grids_N3}


def check_output(output: str | None, prompts_file: str | None) -> None:
    """Refuse an ``--output`` that cannot be written, before any work: the prompts file itself,
    a folder, or a path under a file or in a folder that is not writable."""
    if output is None:
        return
    path = Path(output)
    if prompts_file and path.resolve() == Path(prompts_file).resolve():
        raise ConfigError(
            f"--output {output} is the prompts file, which writing would replace; choose "
            "another output file."
        )
    if path.is_dir():
        raise ConfigError(f"--output {output} is a folder; give a file such as {path}/out.jsonl.")
    check_can_create(path)


def generate_records(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    max_batch: int,
    verbose: bool = True,
    compile: bool = False,
    chat: bool = False,
    media: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[dict[str, Any]]:
    """Run every prompt (request i gets seed + i when a seed is given; ``media[i]`` its
    images) and return one record each. Requests stop at ``params.stop_ids``, else at the tokenizer's eos (and, after
    ``chat`` prompts, the template's end-of-turn token)."""
    check_sampling(params)
    stop = params.stop_ids or (tokenizer.stop_ids(chat) if tokenizer is not None else ())
    requests = [
        Request(
            ids,
            replace(params, stop_ids=stop, seed=None if params.seed is None else params.seed + i),
            media=None if media is None else media[i],
        )
        for i, ids in enumerate(prompt_ids)
    ]
    # A request past the model's context is refused here, alone: the cache then holds the
    # longest request that fits (the refused one must not size every slot's cache), in no
    # more slots than there are requests.
    context = model.config.max_seq_len
    refused = {i: too_long(len(ids), params.max_new_tokens, context)
               for i, ids in enumerate(prompt_ids) if len(ids) + params.max_new_tokens > context}  # fmt: skip
    fitting = [r for i, r in enumerate(requests) if i not in refused]
    start = time.perf_counter()
    ran = []
    if fitting:
        max_len = max(len(r.prompt_ids) for r in fitting) + params.max_new_tokens
        generator = Generator(model, min(max_batch, len(fitting)), max_len=max_len,
                              compile=compile)  # fmt: skip
        ran = generator.generate(fitting)
    seconds = time.perf_counter() - start
    ran_in_order = iter(ran)
    completions = [Completion(finish_reason="error", error=refused[i]) if i in refused
                   else next(ran_in_order) for i in range(len(requests))]  # fmt: skip
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
    generated = sum(len(c.tokens) for c in completions)
    if verbose:
        print(f"{len(requests)} request(s), {generated} tokens in {seconds:.2f} s "
              f"({generated / max(seconds, 1e-9):,.0f} tokens/s)")  # fmt: skip
    return records


def check_sampling(params: SamplingParams) -> None:
    """Refuse sampling settings the generator cannot use (a temperature so small it overflows
    the division of the logits) or that greedy decoding would ignore (top-k, top-p)."""
    if (problem := params.problem()) is not None:
        flag = "--" + problem.split(" ", 1)[0].replace("_", "-")  # it starts with the field
        raise ConfigError(f"{flag}: {problem}.")
    if params.temperature == 0 and (params.top_k > 0 or params.top_p < 1):
        ignored = " and ".join(
            flag for flag, given in (("--top-k", params.top_k > 0), ("--top-p", params.top_p < 1))
            if given
        )  # fmt: skip
        raise ConfigError(
            f"--greedy (or --temperature 0) takes the most likely token, so {ignored} would be "
            "ignored; drop one or the other."
        )


def write_records(output: Path, records: list[dict[str, Any]]) -> None:
    """One JSON line per record, written whole or not at all."""
    atomic_write_text(output, "".join(json.dumps(r) + "\n" for r in records))
