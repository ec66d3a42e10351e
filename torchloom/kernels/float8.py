"""Float8 training of the transformer blocks' linears, with torchao's ``Float8Linear``.

Each converted linear casts its input, weight and output gradient to float8 with dynamic scales
(one per tensor for 'tensorwise', one per row or column for 'rowwise') and runs its three
matmuls (forward, input gradient, weight gradient) as float8 ``torch._scaled_mm``; the weight
and the optimizer stay in high precision. ``Float8Linear`` subclasses ``nn.Linear`` and keeps
the same ``weight`` parameter, so parameter names, state-dict keys, checkpoints and Hugging Face
exports are unchanged.

Only linears inside ``layers.*`` are converted: the output head and the embedding stay in high
precision (as in torchao's and TorchTitan's recipes), and so does any linear whose in or out
features are not a multiple of 16 (what ``_scaled_mm`` needs). Conversion happens when the model
is built, before tensor parallelism, recomputation, compile and FSDP wrap it. With FSDP the
weights are all-gathered in the FSDP compute dtype, not in float8 (torchao's
``enable_fsdp_float8_all_gather`` stays off): simpler, and the same for both recipes.

Float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell).
On the CPU recent PyTorch runs ``_scaled_mm`` as a slow reference, which the
tests use for tiny shapes.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from torchloom.config.errors import ConfigError

TORCHAO_REQUIREMENT = "torchao==0.18.0"
"""The tested torchao (ABI-stable for torch >= 2.11); the optional extra torchloom[float8]."""
FLOAT8_RECIPES = ("tensorwise", "rowwise")
_ALIGNMENT = 16


def convert_linears_to_float8(model: nn.Module, recipe: str) -> list[str]:
    """Swap the eligible linears of ``model``'s blocks for ``Float8Linear`` (in place; works on
    ``meta``); returns the converted module names."""
    with _quiet_cuda_extensions():
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            raise ConfigError(
                f"float8 training ({recipe}) needs torchao: pip install '{TORCHAO_REQUIREMENT}' "
                "(or the extra: pip install 'torchloom[float8]')."
            ) from None
    converted: list[str] = []

    def eligible(linear: nn.Module, name: str) -> bool:
        ok = (
            name.startswith("layers.")
            and linear.in_features % _ALIGNMENT == 0
            and linear.out_features % _ALIGNMENT == 0
        )
        if ok:
            converted.append(name)
        return ok

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return converted


def check_float8_device(recipe: str, device: torch.device) -> None:
    """ConfigError if float8 ``recipe`` (or 'none') cannot run on ``device``; the CPU runs a slow
    reference."""
    if recipe == "none" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"--model.float8 needs float8 tensor cores (compute capability 8.9+: Ada, Hopper, "
            f"Blackwell); {torch.cuda.get_device_name(device)} has {major}.{minor}. Use "
            "--model.float8 none."
        )


@contextmanager
def _quiet_cuda_extensions():
    """On a CPU-only torch build, torchao's wheel logs a warning for each CUDA extension it
    cannot load; float8 training needs none of them, so those warnings are only noise. On any
    build, torch 2.13 logs a deprecation for each Enum torchao registers as a pytree constant
    (torchao's business, not the user's): that logger is quieted while torchao imports too."""
    quiet = [logging.getLogger("torch.utils._pytree")]
    if torch.version.cuda is None:
        quiet.append(logging.getLogger("torchao"))
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
