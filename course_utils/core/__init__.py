"""Layer 1 (bottom): where the course runs, the peers' names, the reference attention, reading source."""
