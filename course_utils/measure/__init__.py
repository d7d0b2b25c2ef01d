"""Layer 5: timing, records and the per-chapter benchmarks. See ``course_utils.layers``."""
