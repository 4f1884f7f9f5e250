"""Ray side of Lattice: cluster topology, placement, the job controller actor and rank actors.

Depends on `training` (never the other way) and never imports `service` or FastAPI. Importing
this package does not import Ray; the submodules that need it do.
"""
