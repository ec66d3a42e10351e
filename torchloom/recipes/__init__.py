"""Built-in recipes. Importing this package registers them."""

from torchloom.recipes import pretrain, sft  # noqa: F401
