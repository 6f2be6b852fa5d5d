"""fusetune: a self-hosted fine-tuning service with fused Triton kernels."""

__version__ = "0.1.0"
