"""PPO and GRPO-family trainers that drive rollout workers and sync weights into them."""
