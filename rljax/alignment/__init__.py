"""Alignment trainers: SFT, reward model, RLHF PPO (placeholder package for issue 4)."""
