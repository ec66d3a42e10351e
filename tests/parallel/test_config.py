import pytest

from torchloom.config import ConfigError
from torchloom.parallel import ParallelConfig


def test_dp_shard_takes_what_is_left():
    resolved = ParallelConfig(tp=2, pp=2).resolve(8)
    assert resolved.dp_shard == 2 and resolved.dp_size == 2
    assert ParallelConfig().resolve(1).dp_shard == 1


def test_products_that_miss_the_world_are_refused_with_numbers():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by .* = 4"):
        ParallelConfig(tp=2, pp=2).resolve(6)
    with pytest.raises(ConfigError, match=r"1 x 2 x 1 x 2 x 1 = 4, but 8 processes"):
        ParallelConfig(dp_shard=2, tp=2).resolve(8)
    with pytest.raises(ConfigError, match="--parallel.tp must be a positive integer"):
        ParallelConfig(tp=0).resolve(1)
    with pytest.raises(ConfigError, match=r"--parallel.ep 3 does not divide dp_shard x cp = 4 x 1"):
        ParallelConfig(ep=3).resolve(4)
