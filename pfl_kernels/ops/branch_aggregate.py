"""Placeholder: filled in by the server-side kernels work (issue 4)."""
__all__: list = []
