"""Lattice service: API, planner, store, scheduler, metrics and CLI."""
