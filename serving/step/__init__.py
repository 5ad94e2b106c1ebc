"""serving.step: see docs/ARCHITECTURE.md."""
