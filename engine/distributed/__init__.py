"""Tensor parallelism inside one worker: a driver rank and N-1 helper ranks
(docs/tensor-parallel.md).

``group.py`` the ranks' collectives (gloo on the CPU, NCCL on CUDA) with their timeout;
``sharding.py`` which slice of each weight and head a rank holds, and the parallel layers;
``weights.py`` reading only a rank's slices from safetensors; ``runner.py`` the driver's and the
helpers' model runner; ``helper.py`` the helper process and the driver's handle on it.
"""
