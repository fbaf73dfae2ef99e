"""Flax NNX networks for rljax, imported as ``rljax.models``."""

from rljax import running_stats
from rljax.models.mlp import (
    MLP,
    ActorCritic,
    ActorCriticConfig,
    gaussian_entropy,
    sample_pre_tanh,
    squashed_log_prob,
)

# Observation normalisation as an (init, update) pair (state: RunningStats).
obs_normalizer_init = running_stats.init
obs_normalizer_update = running_stats.update
