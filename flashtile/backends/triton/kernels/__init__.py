"""Triton kernels; one source per pass."""
