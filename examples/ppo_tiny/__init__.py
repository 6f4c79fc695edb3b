"""PPO on the grpo_tiny addition task: see ppo.toml."""
