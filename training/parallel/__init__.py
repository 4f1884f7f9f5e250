"""Parallelism by technique (tensor, context, expert, fsdp, ddp, zero, recompute, pipeline), the mesh,
and `parallelize`, which applies them in a fixed order."""
