"""Data layer: sources -> tokenizer (and chat template) -> cached token arrays -> packed,
resumable batches, for pre-training text, SFT conversations and multimodal (image) chats; or,
for text, sources mixed by weight and packed on a background thread (StreamingLoader)."""

from torchloom.data.build import DataLoaders, build_dataloaders, build_tokenizer
from torchloom.data.config import DataConfig
from torchloom.data.dataset import TokenDataset
from torchloom.data.loader import RowSource, TrainLoader, ValLoader
from torchloom.data.multimodal import PackedMultimodal
from torchloom.data.multimodal_format import MediaTokens
from torchloom.data.packing import IGNORE_INDEX, Batch, TokenWindows
from torchloom.data.sft import ChatDataset, PackedConversations
from torchloom.data.streaming import StreamingLoader
from torchloom.data.tokenizer import Tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ChatDataset",
    "DataConfig",
    "DataLoaders",
    "MediaTokens",
    "PackedConversations",
    "PackedMultimodal",
    "RowSource",
    "StreamingLoader",
    "TokenDataset",
    "TokenWindows",
    "Tokenizer",
    "TrainLoader",
    "ValLoader",
    "build_dataloaders",
    "build_tokenizer",
]
