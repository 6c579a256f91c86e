"""The ground floor: primitives that every other package imports, and that import nothing of
specdecode but each other and ``errors`` (tests/test_import_graph.py checks it; the packages
above are layered there too).

- ``device.py``: device and dtype selection, host-to-device copies, the CPU's name and flags;
- ``categorical.py``, ``sampling.py``, ``logprobs.py``: logits to probabilities, tokens and
  log-probabilities;
- ``tree.py``, ``tree_mask.py``: token trees, and the ancestor masks and depths tree attention
  reads;
- ``timing.py``: the stopwatch and the one loop that times a pass;
- ``prefix.py``: the common prefix of two token sequences;
- ``paths.py``: where specdecode caches the files it derives;
- ``registry.py``: the method registry, plain data.
"""
