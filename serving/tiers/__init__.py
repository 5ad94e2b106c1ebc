"""serving.tiers: see docs/ARCHITECTURE.md."""
