"""Device work: the model runner, the KV cache tensors, the sampler."""
