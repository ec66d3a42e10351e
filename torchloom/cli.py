"""`torchloom <command>`: train, rl, convert, generate, recipes, plot.

Every command turns bad input into one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchloom.config import (
    ConfigError,
    apply_overrides,
    did_you_mean,
    format_help,
    to_dict,
    validate_tree,
)
from torchloom.config.overrides import split_overrides
from torchloom.recipes import get_recipe, list_recipes
from torchloom.train.job import JobConfig
from torchloom.train.run import resume_command

if TYPE_CHECKING:
    import torch

DEFAULT_RECIPE = "llama3_tiny"

_USAGE = """usage: torchloom <command> [options]

commands:
  train     train a recipe:  torchloom train --recipe NAME [--section.field VALUE ...]
            (--dry-run: check the parallel layout and print per-rank memory, allocating nothing)
  rl        RL post-training of a recipe:  torchloom rl --recipe rl_debug [--rl.field VALUE ...]
  convert   Hugging Face folder <-> torchloom model folder, GGUF file -> either
            (`torchloom convert --help`)
  generate  sample from a model: torchloom generate --from-hf DIR --prompt TEXT (`--help`)
  recipes   list the registered recipes
  plot      draw loss and throughput curves:  torchloom plot OUTPUT_DIR

`torchloom train --recipe NAME --help` lists every option with its help text."""


def _pop_flag(argv: list[str], flag: str) -> bool:
    if flag in argv:
        argv.remove(flag)
        return True
    return False


def _pop_option(argv: list[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == option:
            if i + 1 >= len(argv):
                raise ConfigError(f"{option} needs a value.")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if arg.startswith(option + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def _unexpected(command: str, arg: str, known: list[str]) -> ConfigError:
    """The error for an argument ``command`` did not take: a known option left over was given
    twice (each is read once), anything else is unknown."""
    option = arg.split("=", 1)[0]
    if option in known:
        return ConfigError(f"{option} is given twice for {command}; give it once.")
    return ConfigError(
        f"Unexpected argument {arg!r} for {command}.{did_you_mean(arg, known)} "
        f"Run `torchloom {command} --help`."
    )


def resolve_job(argv: list[str], flags: Collection[str] = ()) -> tuple[str, JobConfig]:
    """(recipe name, job config) from ``--recipe NAME`` and dotted overrides, validated;
    ``flags``: the command's own switches, suggested for a mistyped option."""
    argv = list(argv)
    name = _pop_option(argv, "--recipe") or DEFAULT_RECIPE
    while (again := _pop_option(argv, "--recipe")) is not None:
        if again != name:  # the same name twice changes nothing (cmd_rl may add it again)
            raise ConfigError(f"--recipe is given twice ({name}, {again}); give it once.")
    job = apply_overrides(get_recipe(name).build(), argv, ["--recipe", *flags])
    validate_tree(job)
    _check_batch_options(job, {path.replace("-", "_") for path, _ in split_overrides(argv)})
    return name, job


def _check_batch_options(job: JobConfig, given: set[str]) -> None:
    """Refuse a --training.global_batch_size given on the command line that the global batch
    in tokens (which wins) contradicts."""
    t = job.training
    if (
        "training.global_batch_size" in given
        and t.global_batch_tokens
        and t.global_batch_size != t.global_batch_sequences
    ):
        raise ConfigError(
            f"--training.global_batch_size {t.global_batch_size} and "
            f"--training.global_batch_tokens {t.global_batch_tokens} (= "
            f"{t.global_batch_sequences} sequences of {t.seq_len} tokens) disagree; give one of "
            "the two."
        )


_TRAIN_FLAGS = ("--print-config", "--dry-run", "--world-size")
"""train's own switches besides --recipe and the config's dotted options."""


def cmd_train(argv: list[str]) -> int:
    argv = list(argv)
    if _pop_flag(argv, "--help") or _pop_flag(argv, "-h"):
        name = _pop_option(argv, "--recipe") or DEFAULT_RECIPE
        title = (
            f"torchloom train --recipe {name} [options]  (values shown are this recipe's)\n"
            "  --print-config  print the resolved config and exit\n"
            "  --dry-run       build the model on the meta device under the real layout, check\n"
            "                  that the layout divides it and print each rank's bytes of\n"
            "                  parameters, gradients and optimizer state; allocates nothing\n"
            "  --world-size N  with --dry-run: simulate N ranks in this one process (no torchrun)"
        )
        print(format_help(get_recipe(name).build(), title))
        return 0
    print_config = _pop_flag(argv, "--print-config")
    dry = _pop_flag(argv, "--dry-run")
    while _pop_flag(argv, "--print-config") or _pop_flag(argv, "--dry-run"):
        pass  # a switch given twice is still on
    if print_config and dry:
        raise ConfigError(
            "--print-config prints the resolved config and exits, --dry-run checks the layout "
            "and memory; give one of them."
        )
    world = _pop_option(argv, "--world-size")
    if _pop_option(argv, "--world-size") is not None:
        raise ConfigError("--world-size is given twice for train; give it once.")
    if world is not None and not dry:
        raise ConfigError(
            f"--world-size {world} applies only with --dry-run (it simulates that many ranks in "
            "one process); launch real ranks with torchrun --nproc-per-node N."
        )
    if world is not None and not world.isdigit():
        raise ConfigError(f"--world-size {world}: give a number of ranks, e.g. --world-size 32.")
    name, job = resolve_job(argv, _TRAIN_FLAGS)
    if type(job) is not JobConfig:  # an RL recipe (RLJobConfig) carries its own loop
        raise ConfigError(
            f"Recipe '{name}' is an RL recipe; run it with `torchloom rl --recipe {name}`."
        )
    if print_config:
        from torchloom.models import resolve_model_config

        resolve_model_config(job.model)  # --model.overrides are checked as a run checks them
        print(json.dumps({"recipe": name, **to_dict(job)}, indent=2))
        return 0
    if dry:
        from torchloom.train.dry_run import dry_run

        return dry_run(job, None if world is None else int(world))

    from torchloom.parallel import destroy
    from torchloom.train.run import NothingToTrain
    from torchloom.train.trainer import Trainer, TrainingInterrupted

    # No try/finally: after an error on one rank, leaving the process group would wait for
    # the others (NCCL hangs there), so the process exits with its traceback instead and
    # torchrun stops the other ranks.
    trainer = Trainer(job)
    try:
        result = trainer.train()
    except NothingToTrain as done:  # every rank ends here, having written nothing
        if trainer.is_rank0:
            print(done)
        destroy()
        return 0
    except TrainingInterrupted as err:
        if not trainer.is_rank0:  # rank 0 says where the run stopped
            return 130
        if err.checkpoint:
            err.args = (f"{err} Resume with: {resume_command('train', argv)}",)
        raise
    if trainer.is_rank0:
        validation = (
            ""
            if math.isnan(result.val_loss_before) and math.isnan(result.val_loss_after)
            else f", validation loss {result.val_loss_before:.3f} -> {result.val_loss_after:.3f}"
        )  # no held-out split (--data.val_fraction 0, streaming): no validation to report
        skipped = f" ({result.skipped} skipped as non-finite)" if result.skipped else ""
        print(
            f"done: {result.steps} steps{skipped}, train loss {result.first_loss:.3f} -> "
            f"{result.last_loss:.3f}{validation}"
        )
        _print_sample(trainer, result.model_dir)
    destroy()
    return 0


def cmd_rl(argv: list[str]) -> int:
    """`torchloom rl --recipe NAME`: the same config system as train, with the ``rl`` section."""
    from torchloom.rl.config import NOT_READ, RLJobConfig, check_read

    argv = list(argv)
    name = _pop_option(list(argv), "--recipe") or "rl_debug"
    recipe = get_recipe(name)
    if not isinstance(recipe.build(), RLJobConfig):
        rl_recipes = [r.name for r in list_recipes() if isinstance(r.build(), RLJobConfig)]
        raise ConfigError(
            f"Recipe '{name}' is a training recipe, not an RL one; run it with `torchloom train`, "
            f"or pick an RL recipe: {', '.join(rl_recipes)}."
        )
    if _pop_flag(argv, "--help") or _pop_flag(argv, "-h"):
        title = (
            f"torchloom rl --recipe {name} [options]  (values shown are this recipe's)\n"
            "  --print-config  print the resolved config and exit\n"
            "  --training.steps counts policy updates"
        )
        print(format_help(recipe.build(), title, hidden=NOT_READ))
        return 0
    print_config = _pop_flag(argv, "--print-config")
    for flag in _TRAIN_FLAGS[1:]:
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise ConfigError(
                f"{flag} is an option of `torchloom train`; `torchloom rl` has no dry run. Try "
                "a short run instead (--training.steps 1)."
            )
    overrides = list(argv)
    while _pop_option(overrides, "--recipe") is not None:
        pass
    given = [path.replace("-", "_") for path, _ in split_overrides(overrides)]
    job = apply_overrides(recipe.build(), overrides, ["--recipe", "--print-config"])
    check_read(job, recipe.build(), given)
    if "--recipe" not in argv:
        argv = ["--recipe", name, *argv]
    name, job = resolve_job(argv, ["--print-config"])
    if print_config:
        print(json.dumps({"recipe": name, **to_dict(job)}, indent=2))
        return 0
    from torchloom.parallel import destroy
    from torchloom.rl.loop import RLRunner, prepare_initial_model
    from torchloom.rl.tool_env import PythonToolEnv
    from torchloom.train.builders import check_cap_device
    from torchloom.train.run import NothingToTrain
    from torchloom.train.trainer import TrainingInterrupted

    if job.rl.task == "python_tool":  # refuse an unisolated sandbox before any training
        PythonToolEnv(unsafe_sandbox=job.rl.unsafe_sandbox)
    check_cap_device(job.training.memory_limit_gib, job.training.device)  # likewise
    prepare_initial_model(job)
    trainer = RLRunner(job)
    try:
        result = trainer.train()
    except NothingToTrain as done:  # every rank ends here, having written nothing
        destroy()
        if trainer.dims.is_rank0:
            print(done)
        return 0
    except TrainingInterrupted as err:  # rank 0 says where the run stopped
        destroy(barrier=False)
        if err.checkpoint:
            err.args = (f"{err} Resume with: {resume_command('rl', argv)}",)
        raise
    except BaseException:
        destroy(barrier=False)
        raise
    destroy()
    if trainer.dims.is_rank0:
        print(
            f"done: {result['steps']} policy updates, mean reward {result['reward_first']:.3f} "
            f"(first fifth) -> {result['reward_last']:.3f} (last fifth)"
        )
    return 0


_SAMPLE_MAX_BYTES = 2 * 2**30
"""After a distributed run, the sample loads the saved model onto rank 0 only up to this size:
no rank holds a whole large model that its layout shards."""


def _print_sample(trainer, model_dir: Path | None) -> None:
    """Greedy text after the recipe's prompt, from a single-device copy of the model (the saved
    one when the run was distributed, so no other rank has to take part)."""
    from torchloom.checkpoint.model_io import load_model
    from torchloom.generate.engine import Generator, Request, SamplingParams

    t = trainer.job.training
    if not t.sample_tokens:
        return
    model = trainer.model
    if trainer.dims.world_size > 1:
        if model_dir is None:
            return
        size = trainer.model_config.num_params() * 4
        if size > _SAMPLE_MAX_BYTES:
            print(
                f"sample skipped: the model ({size / 2**30:.1f} GiB) is not gathered onto one "
                f"rank; try `torchloom generate --checkpoint {model_dir} --prompt ...`"
            )
            return
        model = load_model(model_dir, device=trainer.device)[0]
    tok = trainer.tokenizer
    chat = trainer.job.data.format == "chat"  # answer the prompt as a user turn
    prompt_ids = tok.encode_prompt(t.sample_prompt, chat)
    stop_ids = tok.stop_ids(chat)
    params = SamplingParams(t.sample_tokens, temperature=0.0, stop_ids=stop_ids)
    # One short request: graph capture would cost more than it saves.
    max_len = min(len(prompt_ids) + t.sample_tokens, model.config.max_seq_len)
    generator = Generator(model, max_batch=1, max_len=max_len, cuda_graphs=False)
    new = generator.generate([Request(prompt_ids, params)])[0].tokens
    if new and new[-1] in stop_ids:
        new = new[:-1]
    print(f"sample: {t.sample_prompt!r} -> {tok.decode(new)!r}"[:400])


_CONVERT_USAGE = """usage: torchloom convert --from-hf HF_DIR --to OUT_DIR [options]
       torchloom convert --from MODEL_DIR --to-hf HF_DIR [--tokenizer DIR] [options]
       torchloom convert --from-gguf FILE.gguf (--to-hf HF_DIR | --to OUT_DIR) [options]

  --from-hf HF_DIR   a Hugging Face folder (config.json + safetensors) -> a torchloom model folder
  --from MODEL_DIR   a torchloom model folder (e.g. <output_dir>/model) or a complete training
                     checkpoint (<output_dir>/checkpoints/step-N) -> a Hugging Face folder
  --from-gguf FILE   a GGUF file (llama.cpp's format, quantized or not) -> a Hugging Face folder
                     or a torchloom model folder in float weights, with its tokenizer and chat
                     template (needs pip install 'torchloom[gguf]')
  --tokenizer DIR    copy the tokenizer files from DIR (default: those of MODEL_DIR)
  --dtype bf16|fp32  cast floating-point weights (default: keep their dtype; from GGUF: the
                     file's float type, fp32 when it is quantized)
  --max-shard-size   largest weight file, e.g. 2GB, 500MB, 1GiB (default 2GiB)
  --overwrite        replace a non-empty output folder"""
_SIZE_UNITS = {
    "": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"--max-shard-size expects a size such as 2GB or 500MB, got {text!r}.")
    number, unit = match.groups()
    size = int(float(number) * _SIZE_UNITS[(unit or "").upper()])
    if size < 1:
        raise ConfigError(
            f"--max-shard-size {text} leaves no room for a weight file; give a size of at least "
            "1 byte, e.g. 2GB or 500MB."
        )
    return size


def cmd_convert(argv: list[str]) -> int:
    argv = list(argv)
    if _pop_flag(argv, "--help") or _pop_flag(argv, "-h"):
        print(_CONVERT_USAGE)
        return 0
    names = ("from-hf", "from-gguf", "to", "from", "to-hf", "tokenizer", "dtype", "max-shard-size")
    options = {name: _pop_option(argv, f"--{name}") for name in names}
    overwrite = _pop_flag(argv, "--overwrite")
    if argv:
        known = [f"--{name}" for name in options] + ["--overwrite"]
        raise _unexpected("convert", argv[0], known)
    from_hf, from_gguf, to, source, to_hf = (
        options[k] for k in ("from-hf", "from-gguf", "to", "from", "to-hf")
    )
    if not (
        (from_hf and to and not (source or to_hf or from_gguf))
        or (source and to_hf and not (from_hf or to or from_gguf))
        or (from_gguf and bool(to) != bool(to_hf) and not (from_hf or source))
    ):
        raise ConfigError(
            "convert needs either --from-hf HF_DIR --to OUT_DIR, --from MODEL_DIR --to-hf HF_DIR "
            "or --from-gguf FILE.gguf with one of --to-hf HF_DIR or --to OUT_DIR."
        )
    if from_hf and options["tokenizer"]:
        raise ConfigError("--tokenizer goes with --to-hf; --from-hf copies HF_DIR's tokenizer.")
    if from_gguf and options["tokenizer"]:
        raise ConfigError("--tokenizer goes with --from; --from-gguf writes the file's tokenizer.")
    max_shard = options["max-shard-size"]

    from torchloom.checkpoint.convert import convert_from_hf, convert_to_hf
    from torchloom.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_BYTES

    shard_bytes = _parse_size(max_shard) if max_shard else DEFAULT_MAX_SHARD_BYTES
    start = time.perf_counter()
    if from_gguf:
        from torchloom.checkpoint.gguf import convert_from_gguf

        output = Path(to_hf or to)
        summary = convert_from_gguf(
            Path(from_gguf), output, bool(to_hf), options["dtype"], shard_bytes, overwrite
        )
    elif from_hf:
        output = Path(to)
        summary = convert_from_hf(Path(from_hf), output, options["dtype"], shard_bytes, overwrite)
    else:
        output = Path(to_hf)
        tokenizer = Path(options["tokenizer"]) if options["tokenizer"] else None
        summary = convert_to_hf(
            Path(source), output, options["dtype"], tokenizer, shard_bytes, overwrite
        )
    print(
        f"wrote {output}: {summary.num_tensors} tensors, {summary.total_bytes / 1e9:.3f} GB in "
        f"{len(summary.files)} file(s), {time.perf_counter() - start:.1f} s"
    )
    return 0


_GENERATE_USAGE = """usage: torchloom generate (--from-hf HF_DIR | --checkpoint DIR)
                          (--prompt TEXT ... | --prompts-file F.jsonl) [options]

  --from-hf HF_DIR        a Hugging Face model folder (config.json, safetensors, tokenizer)
  --checkpoint DIR        a torchloom model folder (<output_dir>/model) or a training
                          checkpoint step (<output_dir>/checkpoints/step-N)
  --prompt TEXT           a prompt (repeatable)
  --image PATH            an image shown before the --prompt text, in one user message
                          (repeatable, in order; needs --chat and one --prompt and a
                          vision-language model)
  --prompts-file F.jsonl  one object per line: {"prompt": "text"}, {"prompt_ids": [1, 2]} or,
                          with --chat, {"messages": [{"role": "user", "content": "..."}]};
                          a content may be a list of parts, {"type": "text", "text": ...} and
                          {"type": "image", "path": ...} (relative to the file)
  --chat                  apply the model's chat template (each text is one user message) and
                          open the assistant's reply; stop at the template's end-of-turn token
                          (e.g. <|im_end|>) as well as eos: for models tuned on chats (SFT)
  --max-new-tokens N      tokens to generate per request (default 64)
  --greedy                argmax decoding (same as --temperature 0)
  --temperature T         softmax temperature (default 1.0)
  --top-k K / --top-p P   sample among the k most likely tokens / the top-p mass
  --seed S                request i samples with seed S + i (reproducible)
  --max-batch N           requests decoded together (default 8; more wait their turn)
  --batch-invariant       fixed-order kernels: each request's tokens and logprobs are bitwise
                          the same whatever shares its batch, and equal the trainer's forward
                          with --model.batch_invariant true (Triton kernels on CUDA, slow
                          reference kernels on the CPU)
  --dtype bf16|fp32       weights' dtype (default: as stored)
  --device cpu|cuda       default: cuda when available
  --compile               compile the decode step with inductor (GPU: about a minute first)
  --tp N                  tensor parallelism over the N processes of a torchrun job
                          (torchrun --nproc-per-node N -m torchloom generate ... --tp N);
                          rank 0 writes the output
  --output F.jsonl        one line per request, in input order: tokens, logprobs, text,
                          finish_reason (stop | length | error) and error

A request that fails (say, a prompt longer than the context) gets finish_reason error and a
warning; when every request fails, nothing is written and the exit status is 1."""
_GENERATE_FLAGS = ("greedy", "batch-invariant", "compile", "chat")
# Each numeric option: its type, its default, the values it takes, and those in words.
_GENERATE_NUMBERS: dict[str, tuple[type, Any, Callable[[Any], bool], str]] = {
    "max-new-tokens": (int, 64, lambda v: v >= 1, "an integer >= 1"),
    "temperature": (float, 1.0, lambda v: 0 <= v < math.inf, "a number >= 0 (0 is greedy)"),
    "top-k": (int, 0, lambda v: 0 <= v < 2**31, "an integer in [0, 2**31) (0 keeps every token)"),
    "top-p": (float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    # Request i samples with seed + i: the bound leaves room for any number of prompts.
    "seed": (int, None, lambda v: 0 <= v < 2**62, "an integer in [0, 2**62)"),
    "max-batch": (int, 8, lambda v: v >= 1, "an integer >= 1"),
    "tp": (int, 1, lambda v: v >= 1, "an integer >= 1"),
}
_GENERATE_OPTIONS = ("from-hf", "checkpoint", "prompts-file", "dtype", "device", "output",
                     *_GENERATE_NUMBERS)  # fmt: skip


def _number(options: dict[str, str | None], name: str) -> Any:
    """The value of the numeric option ``--name``, or a ConfigError saying what it takes."""
    kind, default, allowed, requirement = _GENERATE_NUMBERS[name]
    text = options[name]
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not allowed(value):  # nan fails every comparison, so it lands here
        raise ConfigError(f"--{name} must be {requirement}; got {text!r}.")
    return value


def _generate_device(name: str | None) -> torch.device:
    """The torch device of ``--device``, refused when this machine has no such device."""
    import torch

    from torchloom.config.devices import checked_device

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return checked_device(name, "--device")


def cmd_generate(argv: list[str]) -> int:
    argv = list(argv)
    if _pop_flag(argv, "--help") or _pop_flag(argv, "-h"):
        print(_GENERATE_USAGE)
        return 0
    prompts, images = [], []
    while (prompt := _pop_option(argv, "--prompt")) is not None:
        prompts.append(prompt)
    while (image := _pop_option(argv, "--image")) is not None:
        images.append(image)
    options = {name: _pop_option(argv, f"--{name}") for name in _GENERATE_OPTIONS}
    flags = {name: _pop_flag(argv, f"--{name}") for name in _GENERATE_FLAGS}
    if argv:
        known = [f"--{n}" for n in (*_GENERATE_OPTIONS, "prompt", "image", *_GENERATE_FLAGS)]
        raise _unexpected("generate", argv[0], known)
    if bool(options["from-hf"]) == bool(options["checkpoint"]):
        raise ConfigError("generate needs exactly one of --from-hf HF_DIR or --checkpoint DIR.")

    import torch

    from torchloom.generate.engine import CacheTooLarge, SamplingParams
    from torchloom.generate.run import (
        check_output,
        check_sampling,
        encode_image_prompts,
        encode_prompts,
        generate_records,
        load_model_and_tokenizer,
        read_prompts,
    )

    params = SamplingParams(
        max_new_tokens=_number(options, "max-new-tokens"),
        temperature=0.0 if flags["greedy"] else _number(options, "temperature"),
        top_k=_number(options, "top-k"),
        top_p=_number(options, "top-p"),
        seed=_number(options, "seed"),
    )
    if flags["greedy"] and options["temperature"] is not None:
        raise ConfigError(
            f"--greedy takes the most likely token, so --temperature {options['temperature']} "
            "would be ignored; drop one of the two."
        )
    check_sampling(params)  # before the model is loaded
    device = _generate_device(options["device"])
    tp, max_batch = _number(options, "tp"), _number(options, "max-batch")
    chat, compile_decode = flags["chat"], flags["compile"]
    batch_invariant = flags["batch-invariant"]
    if compile_decode and tp > 1:
        raise ConfigError("--compile is not verified with --tp yet; drop one of the two.")
    if compile_decode and batch_invariant:
        raise ConfigError(
            "--compile and --batch-invariant do not mix: inductor's fused pointwise code rounds "
            "differently from the trainer's eager forward. Drop --compile (the decode steps "
            "still replay from CUDA graphs)."
        )
    # Everything the user typed is checked before the model loads and before anything is written.
    items = read_prompts(prompts, options["prompts-file"], chat, images)
    check_output(options["output"], options["prompts-file"])
    rank0 = True
    if tp > 1:
        import torch.distributed as dist

        from torchloom.parallel.mesh import destroy, init_distributed

        device = init_distributed(device.type)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        # Every rank must draw the same samples: one global seed for requests without --seed.
        seed = [torch.randint(0, 2**31, ()).item()]
        if dist.is_initialized():
            dist.broadcast_object_list(seed, src=0)
        torch.manual_seed(seed[0])
    try:
        model, tokenizer = load_model_and_tokenizer(
            options["from-hf"], options["checkpoint"], device, options["dtype"],
            batch_invariant, tp,
        )  # fmt: skip
        media = None
        if any(item.has_images for item in items):
            prompt_ids, media = map(list, zip(*encode_image_prompts(items, tokenizer, model)))
        else:
            prompt_ids = encode_prompts(items, tokenizer, chat)
        try:
            records = generate_records(
                model, tokenizer, prompt_ids, params, max_batch, rank0, compile_decode, chat,
                media,
            )  # fmt: skip
        except CacheTooLarge as err:
            raise ConfigError(
                f"--max-batch {max_batch}: the cache of {err.slots} requests of up to "
                f"{err.max_len} tokens {err.sizes}; lower --max-batch or --max-new-tokens."
            ) from None
        if tp > 1:
            destroy()  # every rank together
    finally:
        if tp > 1:
            destroy(barrier=False)  # after an error: a peer may never arrive
    if not rank0:
        return 0
    return _report_generation(records, [item.where for item in items], options["output"])


def _report_generation(records: list[dict[str, Any]], where: list[str], output: str | None) -> int:
    """Write (or print) the records; when every request failed, write nothing and return 1.
    ``where[i]`` says where request i came from, to point at the first failure."""
    from torchloom.generate.run import write_records

    failed = [r for r in records if "error" in r]
    if failed:
        summary = f"{len(failed)} of {len(records)} requests failed"
        first = f"the first ({where[failed[0]['index']]}): {failed[0]['error']}"
        if len(failed) == len(records):
            print(f"error: {summary}, so nothing was written; {first}.", file=sys.stderr)
            return 1
        print(f"warning: {summary} (see their records' error); {first}.", file=sys.stderr)
    if output is None:
        for record in records:
            print(json.dumps({k: v for k, v in record.items() if k != "logprobs"}))
    else:
        write_records(Path(output), records)
        print(f"wrote {output}")
    return 0


def cmd_recipes(argv: list[str]) -> int:
    if argv in (["--help"], ["-h"]):
        print("usage: torchloom recipes (lists the registered recipes, one line each)")
        return 0
    if argv:
        raise ConfigError(
            f"torchloom recipes takes no arguments (got {' '.join(argv)}); it lists the "
            "recipes. See one's options with torchloom train --recipe NAME --help."
        )
    recipes = list_recipes()
    width = max(len(r.name) for r in recipes)
    for recipe in recipes:
        marker = " (default)" if recipe.name == DEFAULT_RECIPE else ""
        print(f"{recipe.name:<{width}}  {recipe.summary}{marker}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    usage = (
        "usage: torchloom plot OUTPUT_DIR [--metric NAME ...] (a folder holding metrics.jsonl; "
        "--metric draws those metrics against step, e.g. --metric eval_pass@1)"
    )
    argv, names = list(argv), []
    if _pop_flag(argv, "--help") or _pop_flag(argv, "-h"):
        print(usage)
        return 0
    while (name := _pop_option(argv, "--metric")) is not None:
        names.append(name)
    unknown = [a for a in argv if a.startswith("-")]
    if unknown:
        raise ConfigError(f"Unknown option {unknown[0]} for plot. {usage}")
    if len(argv) != 1:
        raise ConfigError(usage)
    if Path(argv[0]).is_file():  # metrics.jsonl itself: its folder is meant
        argv[0] = str(Path(argv[0]).parent)
    from torchloom.train.plot import plot_metrics, plot_named

    png = plot_named(Path(argv[0]), names) if names else plot_metrics(Path(argv[0]))
    print(f"wrote {png}")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train,
    "rl": cmd_rl,
    "convert": cmd_convert,
    "generate": cmd_generate,
    "recipes": cmd_recipes,
    "plot": cmd_plot,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(
            f"error: unknown command '{command}'.{did_you_mean(command, COMMANDS)}", file=sys.stderr
        )
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: {command} was interrupted (Ctrl-C).", file=sys.stderr)
        return 130  # the shell's code for a SIGINT
    except RuntimeError as err:
        from torchloom.checkpoint.storage import CheckpointError
        from torchloom.train.trainer import TrainingError, TrainingInterrupted

        if not isinstance(err, TrainingError | CheckpointError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 130 if isinstance(err, TrainingInterrupted) else 1


if __name__ == "__main__":
    sys.exit(main())
