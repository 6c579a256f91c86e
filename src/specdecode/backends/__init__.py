"""Where forward passes run: the interface (base.py), the torch backend (torch_backend.py),
llama.cpp for GGUF files on CPUs (llamacpp.py, llamacpp_sequence.py), device helpers (device.py)."""
