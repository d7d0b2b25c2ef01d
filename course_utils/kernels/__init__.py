"""Layer 2: the TileLang kernels and their pieces (imports ``core`` only). See ``course_utils.layers``."""
