"""Where model passes run: the torch models (``specdecode.models``) or llama.cpp (``llamacpp``)."""
