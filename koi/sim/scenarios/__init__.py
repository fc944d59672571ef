"""Shipped scenario files (package data)."""
