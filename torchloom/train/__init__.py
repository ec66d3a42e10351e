"""Training: the loop, the loss, optimizers and schedules, metrics."""
