"""Shipped HF configs (package data)."""
