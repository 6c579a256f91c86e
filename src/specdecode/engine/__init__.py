"""Decoding loops: one request (single.py) and continuous batches (batch.py), with the pure verification maths."""
