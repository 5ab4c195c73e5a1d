"""What every rank runs: the model runner, its CUDA graphs and KV cache, tensor-parallel workers."""
