"""Koi: a self-calibrating planner for heterogeneous, multi-cloud LLM inference fleets."""

from koi.numerics import pin_kernels

pin_kernels()  # before anything imports numpy: the same seed, the same numbers on any x86-64 machine with AVX2

__version__ = "0.1.0"
