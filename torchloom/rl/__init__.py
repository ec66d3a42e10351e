"""Reinforcement learning post-training: rollouts from the generator, losses, environments and
rewards, weight sync and the RL loop (`torchloom rl`). See docs/rl.md."""
