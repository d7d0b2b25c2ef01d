"""Layer 6: plots, diagrams and widgets for the chapters. See ``course_utils.layers``."""
