"""The ablation versions of chapters 07 (forward) and 08 (backward): the shipped kernels' pieces, swapped."""
