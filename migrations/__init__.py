"""Alembic environment and versions of the Lattice store (see service.store.migrate)."""
