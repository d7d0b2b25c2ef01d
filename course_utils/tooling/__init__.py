"""Layer 8 (top): the course's tools (workspace, notebook runner, summary, self-checks, codegen snapshot)."""
