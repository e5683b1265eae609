"""Example jobs that train real models on data bundled with their packages (no download)."""
