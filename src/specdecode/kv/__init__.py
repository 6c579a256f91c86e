"""KV caches: the static cache written by position and the paged block pool."""
