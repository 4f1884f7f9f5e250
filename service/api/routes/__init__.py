"""The API routes, one module per resource (jobs, plans, faults, cluster, tokens, health)."""
