"""Generation on the same model modules the trainer trains."""
