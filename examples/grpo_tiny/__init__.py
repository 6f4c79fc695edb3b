"""grpo_tiny: GRPO on CPU teaches a tiny pre-trained Llama to add two numbers."""
