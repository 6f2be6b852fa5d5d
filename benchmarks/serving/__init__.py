"""Benchmarks of the chat completions serving path (fusetune/serving)."""
