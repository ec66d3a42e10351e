"""Parallelism applied to single-device models from outside: mesh and degrees."""

from torchloom.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
