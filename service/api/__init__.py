"""The HTTP API: the FastAPI app, its dependencies, error documents and routes."""
