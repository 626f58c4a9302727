"""Multi-device execution over torch.distributed: tensor parallelism (tensor_parallel.py shards a
loaded model, comm.py holds the collectives its layers call, workers.py runs ranks 1..N-1)."""
