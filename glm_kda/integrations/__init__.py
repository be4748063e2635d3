"""Bridges to the libraries people already run the block in (optional extras)."""
