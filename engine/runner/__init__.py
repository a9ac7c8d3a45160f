"""The device side: the model runner, its input batch, CUDA graphs, the KV cache tensors, the
sampler and the greedy screen, and the device and dtype policy."""
