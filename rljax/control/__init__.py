"""Control trainers: PPO over vectorized MJX environments."""
