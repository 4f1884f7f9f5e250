"""Pure PyTorch side of Lattice: what one rank runs. Never imports Ray or FastAPI.

Submodules that need torch import it themselves; `training.config.layout` and `training.config.spec`
are pure Python so that the planner can use them without importing torch.
"""
