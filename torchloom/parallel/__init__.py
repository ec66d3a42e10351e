"""Parallelism applied to single-device models from outside: mesh, data and tensor parallel."""

from torchloom.parallel.config import ParallelConfig
from torchloom.parallel.grad import clip_coefficient, clip_grad_norm_, grad_norm
from torchloom.parallel.loss_reduction import (
    as_local,
    global_label_count,
    max_over_data_ranks,
    sum_over_data_ranks,
)
from torchloom.parallel.mesh import (
    ParallelDims,
    build_parallel_dims,
    destroy,
    init_distributed,
    leave,
)
from torchloom.parallel.parallelize import parallelize
from torchloom.parallel.tensor_parallel import loss_context

__all__ = [
    "ParallelConfig",
    "ParallelDims",
    "as_local",
    "build_parallel_dims",
    "clip_coefficient",
    "clip_grad_norm_",
    "destroy",
    "global_label_count",
    "grad_norm",
    "init_distributed",
    "leave",
    "loss_context",
    "max_over_data_ranks",
    "parallelize",
    "sum_over_data_ranks",
]
