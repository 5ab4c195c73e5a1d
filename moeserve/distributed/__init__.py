"""Tensor parallelism: the parallel state handed to layers, and how weights and adapters are split per rank."""
