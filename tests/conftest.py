import os

import pytest
import torch

# Two cores: keep intra-op threads predictable and avoid oversubscription under pytest.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def shared_cache_dir(tmp_path_factory):
    """One cache (built-in corpus, tokenizer, tokenized data) for the whole test session."""
    path = tmp_path_factory.mktemp("torchloom_cache")
    previous = os.environ.get("TORCHLOOM_CACHE")
    os.environ["TORCHLOOM_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("TORCHLOOM_CACHE", None)
    else:
        os.environ["TORCHLOOM_CACHE"] = previous
