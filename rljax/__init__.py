"""rljax: one jit-compiled PPO core for MuJoCo control and LLM alignment.

The top-level folders ``envs/``, ``models/`` and ``sharding/`` are installed as
``rljax.envs``, ``rljax.models`` and ``rljax.sharding`` (see ``pyproject.toml``).
"""

__version__ = "0.1.0"
