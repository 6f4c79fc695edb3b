"""agentic_calc: GRPO on CPU teaches a tiny pre-trained Llama to call a calculator tool in multi-turn sessions."""
