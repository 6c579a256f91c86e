"""Pass costs and the draft-length policies (one request and a batch)."""
