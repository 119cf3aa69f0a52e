"""specjax: speculative decoding in JAX (Leviathan et al. 2022; Chen et al. 2023)."""

__version__ = "0.1.0"
