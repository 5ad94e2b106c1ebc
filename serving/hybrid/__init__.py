"""serving.hybrid: see docs/ARCHITECTURE.md."""
