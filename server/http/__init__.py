"""The HTTP door: the FastAPI app, its routes, the page, bounded connections."""
