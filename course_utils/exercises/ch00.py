"""Chapter 00's exercise (axpy) is checked in the notebook with ``check_exercise``; its hints live here."""

HINTS = {
    "a": ["The kernel is vector_add with one line changed: each element of the output is alpha times the "
          "element of A plus the element of B.",
          "Inside `for i in tb.parallel(block):` the tiles `a` and `b` hold this block's elements; assign "
          "`a[i]` from `alpha`, `a[i]` and `b[i]` (alpha is a Python number: it becomes a constant)."],
}
