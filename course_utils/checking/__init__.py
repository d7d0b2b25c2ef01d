"""Layer 4: check primitives and the checks of the course's kernels with planted bugs."""
