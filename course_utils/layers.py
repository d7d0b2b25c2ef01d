"""The layers of ``course_utils``, bottom to top: a module imports only from its own layer or one below.

Each layer is a subpackage; ``tests/test_layers.py`` reads every module's imports (function-level
ones included) and fails on an upward import or an import circle.

- ``core``: where the course runs (``device``), the names of the peers (``labels``), the PyTorch
  reference attention and its input checks (``reference``), reading code and generated CUDA (``source``).
  Imports nothing of the course.
- ``kernels``: the TileLang kernels and their pieces (``tiles``, ``flash_pieces``, ``hopper_pieces``,
  ``softmax``, ``flash_fwd*``, ``flash_bwd*``, ``flash_varlen*``, ``flash_decode``, ``flash_flex*``,
  ``flex_pieces``), the tracer the flex kernels call while they build (``flex_trace``: a modifier on
  kernel values, which refuses what it cannot compile), and in ``kernels/versions`` the ablation
  versions of chapters 07 and 08. A kernel factory returns a ``@T.prim_func``; nothing here validates
  the inputs of a call or caches compiled kernels.
- ``api``: the front doors (``attention``: ``flash_attention``; ``varlen_api``: packed batches;
  ``decode_api``: decoding; ``flex``: ``flex_attention`` and its block masks; ``ring``, ``gloo``: ring
  attention; ``ring_harness``: ring attention run and checked on gloo processes), which check inputs, pick
  a kernel and its tiling, and compile and cache it (``registry``, ``compiled``).
- ``checking``: the check primitives (``checks``), the checks of the course's kernels against the
  references with planted bugs (``validation``), flex attention's float64 reference (``flex_reference``)
  and the correctness gate (``fuzz``).
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
