"""torchloom: PyTorch-native pre-training, post-training and RL of large generative models."""

__version__ = "0.1.0"
