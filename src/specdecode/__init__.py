"""Speculative decoding for Llama-family models."""
