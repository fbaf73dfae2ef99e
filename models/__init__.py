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


# Decoder LMs (Llama/Qwen2), Hugging Face checkpoint and tokenizer IO.
from rljax.models import axes
from rljax.models.hf_io import CheckpointError, load_hf_checkpoint, read_hf_config, save_hf_checkpoint
from rljax.models.llm import (
    DecoderLM,
    KVCache,
    LayerCache,
    LMConfig,
    RopeScaling,
    init_cache,
    last_token_index,
    positions_from_mask,
    sequence_log_probs,
    token_log_probs,
)
from rljax.models.tokenizer import (
    GenerationConfig,
    Tokenizer,
    eos_token_ids,
    load_generation_config,
    load_tokenizer,
)
