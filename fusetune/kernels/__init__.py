"""Fused Triton kernels for training causal language models.

This package imports nothing else of fusetune.
"""
