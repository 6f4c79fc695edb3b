"""Draft-model speculator."""
