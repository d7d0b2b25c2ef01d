"""Layer 3: the front doors (dense, packed, decode, ring) over the kernels. See ``course_utils.layers``."""
