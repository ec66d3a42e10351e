"""Op implementations the model's component slots choose from: PyTorch references and fused
or memory-saving variants (each tested against its reference)."""
