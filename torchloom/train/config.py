"""The `training` section: steps, batch geometry, precision, seeding, validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torchloom.config.errors import ConfigError


@dataclass
class TrainingConfig:
    steps: int = 100
    """Optimizer steps to run."""
    seq_len: int = 256
    """Tokens per training sequence."""
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over all data-parallel ranks."""
    global_batch_tokens: int = 0
    """If > 0, the global batch in tokens instead (must be a multiple of seq_len)."""
    micro_batch_size: int = 0
    """Sequences per forward pass on one rank; 0 means the rank's whole share (no
    accumulation). Gradient accumulation steps are derived from the global batch."""
    seed: int = 0
    """Seed for weight init, data order and dropout-free randomness; same seed, same losses."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks the GPU when there is one."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype: auto is bf16 autocast on the GPU and fp32 on the CPU."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    skip_nonfinite: bool = False
    """Skip an optimizer step whose loss or gradient norm is nan/inf instead of stopping the
    run; the end of the run says how many were skipped, and a run that skipped every step or
    ends with non-finite weights or validation loss still stops with an error."""
    val_interval: int = 0
    """Compute the validation loss every this many steps (0: only before and after training)."""
    val_sequences: int = 32
    """Held-out sequences per validation, summed over ranks (rounded up to whole batches)."""
    deterministic: bool = False
    """Use deterministic algorithms (bitwise repeatable on the GPU, somewhat slower)."""
    cuda_graph: bool = False
    """Capture the whole step (forward, backward, clipping, AdamW) as one CUDA graph after 3
    eager steps and replay it, saving the per-kernel launch cost; losses are bitwise those of
    eager steps. One GPU, static shapes, no skip_nonfinite: see docs/performance.md."""
    memory_limit_gib: float = 0.0
    """Cap this process's CUDA caching allocator at this many GiB (0: no cap). Past the cap
    the allocator hands its unused cached blocks back to the device and retries before it
    reports out of memory, so a run holds about this much (plus the CUDA context, outside the
    allocator) however its blocks fragment, at the cost of those releases. For a GPU shared
    with other work, or a run held to a memory budget: see docs/performance.md."""
    sample_prompt: str = "The"
    """Prompt of the greedy text sample printed at the end of training (not empty)."""
    sample_tokens: int = 32
    """New tokens in that sample; 0 disables it."""

    def validate(self) -> None:
        for name in ("steps", "seq_len", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--training.{name} must be at least 1; got {getattr(self, name)}."
                )
        if self.steps >= 2**31:
            raise ConfigError(f"--training.steps must be below 2**31; got {self.steps}.")
        if self.micro_batch_size < 0:
            raise ConfigError("--training.micro_batch_size must be >= 0 (0: no accumulation).")
        if self.global_batch_tokens < 0:
            raise ConfigError(
                "--training.global_batch_tokens must be >= 0 (0: use "
                f"--training.global_batch_size); got {self.global_batch_tokens}."
            )
        if self.global_batch_tokens and self.global_batch_tokens % self.seq_len:
            raise ConfigError(
                f"--training.global_batch_tokens {self.global_batch_tokens} is not a multiple of "
                f"--training.seq_len {self.seq_len}; use "
                f"{(self.global_batch_tokens // self.seq_len or 1) * self.seq_len}."
            )
        if not 0 <= self.max_norm < math.inf:  # nan too
            raise ConfigError(
                "--training.max_norm must be a finite number >= 0 (0 disables clipping); got "
                f"{self.max_norm}."
            )
        if not 0 <= self.seed < 2**63:  # numpy takes no negative seed
            raise ConfigError(f"--training.seed must be in [0, 2**63); got {self.seed}.")
        for name in ("val_interval", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--training.{name} must be >= 0; got {getattr(self, name)}.")
        if self.sample_tokens and not self.sample_prompt:
            raise ConfigError(
                f"--training.sample_prompt is empty, so the {self.sample_tokens}-token sample "
                "would have nothing to continue; give a prompt, e.g. --training.sample_prompt "
                "The, or --training.sample_tokens 0 for no sample."
            )
        if self.val_sequences < 1:
            raise ConfigError(
                f"--training.val_sequences must be at least 1; got {self.val_sequences} (set "
                "--data.val_fraction 0 to turn validation off)."
            )
        if not 0 <= self.memory_limit_gib < math.inf:  # nan too
            raise ConfigError(
                "--training.memory_limit_gib must be a finite number of GiB >= 0 (0: no cap); "
                f"got {self.memory_limit_gib}."
            )
        if self.memory_limit_gib and self.device == "cpu":
            raise ConfigError(
                "--training.memory_limit_gib caps the CUDA allocator; it does nothing with "
                "--training.device cpu: drop it or train on a GPU."
            )
        if self.cuda_graph and self.device == "cpu":
            raise ConfigError(
                "--training.cuda_graph true needs a CUDA GPU, not --training.device cpu."
            )
        if self.cuda_graph and self.skip_nonfinite:
            raise ConfigError(
                "--training.skip_nonfinite true decides on the host whether to step, which a "
                "captured step cannot do; drop it or --training.cuda_graph."
            )

    @property
    def global_batch_sequences(self) -> int:
        """The global batch in sequences, whichever way it was given."""
        if self.global_batch_tokens:
            return self.global_batch_tokens // self.seq_len
        return self.global_batch_size
