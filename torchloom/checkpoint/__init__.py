"""Saving and loading: the model-only export written at the end of training."""
