"""LLM alignment: SFT, Bradley-Terry reward models, and RLHF (PPO, GRPO, RLOO, REINFORCE++)."""
