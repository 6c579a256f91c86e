"""Where forward passes run: the device helpers, the torch backend, llama.cpp."""
