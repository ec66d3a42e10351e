"""Saving and loading: streaming sharded safetensors, torchloom's model folder (written at the end
of training), and Hugging Face import/export."""
