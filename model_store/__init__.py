"""Model catalog, seeded model factory and archive builder."""
