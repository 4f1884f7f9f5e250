"""Lattice models in and out: Hugging Face Llama/Mixtral and plain torch checkpoints.

- ``names``: torch-free: the canonical tensor shapes of a ModelSpec, the Hugging Face config and
  tensor names, what cannot be mapped, and the shapes inside safetensors/torch files (read without
  torch, so the service can refuse a mismatched ``model.init_from`` at submit).
- ``hf``: the tensor conversion (Q/K rotary permutation, MoE expert layout).
- ``export``: ``python -m training.interop.export``: a DCP checkpoint -> HF or torch files.
- ``load``: the canonical state dict of ``model.init_from`` weights, for the train loop.
"""
