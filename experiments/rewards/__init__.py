"""Example reward functions for ``train_rlhf.py --reward_fn=rewards.MODULE:FUNCTION``."""
