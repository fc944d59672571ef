"""Typed repositories, one module per concern. Callers never write SQL."""
