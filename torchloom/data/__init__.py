"""Data layer: sources -> tokenizer -> cached token arrays -> packed, resumable batches."""

from torchloom.data.build import DataLoaders, build_dataloaders, build_tokenizer
from torchloom.data.config import DataConfig
from torchloom.data.dataset import TokenDataset
from torchloom.data.loader import PretrainLoader, ValLoader
from torchloom.data.packing import IGNORE_INDEX, Batch
from torchloom.data.tokenizer import Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "DataConfig",
    "DataLoaders",
    "PretrainLoader",
    "TokenDataset",
    "Tokenizer",
    "ValLoader",
    "build_dataloaders",
    "build_tokenizer",
]
