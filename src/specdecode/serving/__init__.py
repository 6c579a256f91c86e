"""The OpenAI-compatible HTTP server and the thread that steps the batch engine for it."""
