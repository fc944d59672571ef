"""Koi: a self-calibrating planner for heterogeneous, multi-cloud LLM inference fleets."""

__version__ = "0.1.0"
