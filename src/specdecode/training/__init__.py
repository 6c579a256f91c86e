"""Training and search: head features, Medusa/EAGLE heads, distillation, the layer-skip search."""
