"""Where forward passes run: the interface (base.py), the torch backend (torch_backend.py),
llama.cpp for GGUF files on CPUs (llamacpp.py, llamacpp_binding.py, llamacpp_decode.py,
llamacpp_repack.py, llamacpp_sequence.py, llamacpp_threads.py), which one runs a model
(select.py) and which runs a batch (batch_select.py); device helpers are core/device.py."""
