"""serving.cache: see docs/ARCHITECTURE.md."""
