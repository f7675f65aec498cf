"""The torch state codec: a nested training state (tensors, DTensor pieces, RNG states, small JSON
trees) to and from bytes, without pickle."""
