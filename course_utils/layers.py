"""The layers of ``course_utils``, bottom to top: a module imports only from its own layer or one below.

Each layer is a subpackage; ``tests/test_layers.py`` reads every module's imports (function-level
ones included) and fails on an upward import or an import circle.

- ``core``: where the course runs (``device``), the names of the peers (``labels``), the PyTorch
  reference attention and its input checks (``reference``), reading code and generated CUDA (``source``).
  Imports nothing of the course.
- ``kernels``: the TileLang kernels and their pieces (``tiles``, ``flash_pieces``, ``hopper_pieces``,
  ``softmax``, ``flash_fwd*``, ``flash_bwd*``, ``flash_varlen*``, ``flash_decode``), and in
  ``kernels/versions`` the ablation versions of chapters 07 and 08. A kernel factory returns a
  ``@T.prim_func``; nothing here validates user input or caches compiled kernels.
- ``api``: the front doors (``attention``: ``flash_attention``; ``varlen_api``: packed batches;
  ``decode_api``: decoding; ``ring``, ``gloo``: ring attention; ``ring_harness``: ring attention run and
  checked on gloo processes), which check inputs, pick a kernel and its tiling, and compile and cache it.
- ``checking``: the check primitives (``checks``) and the checks of the course's kernels against the
  references with planted bugs (``validation``).
- ``measure``: timing and records (``bench``), the memory of ring attention's lap against its accounting
  (``ring_memory``) and the per-chapter benchmarks (``benchmarks/``).
- ``pictures``: plots, diagrams and widgets for the chapters.
- ``exercises``: the chapters' exercise checkers.
- ``tooling``: the course's own tools: learner workspace, notebook runner, README summary, the
  self-checks of ``python -m course_utils.check``, the codegen snapshot.
- the package root: ``course_utils`` (the names the chapters use as ``cu.X``), ``check`` (the runner)
  and this module.
"""

LAYERS = ("core", "kernels", "api", "checking", "measure", "pictures", "exercises", "tooling")
