"""The layout is the architecture: a module imports only from its own layer or below, and no import circle.

Every module of ``course_utils`` is parsed with ``ast``; every import in it counts, at module level or
inside a function. The layer order is ``course_utils.layers.LAYERS``; the package root
(``course_utils/__init__.py``, ``check.py``, ``layers.py``) sits above every layer.
"""

import ast
from pathlib import Path

import pytest

from course_utils.layers import LAYERS

PACKAGE = Path(__file__).resolve().parent.parent / "course_utils"
ROOT = "root"
ORDER = {**{layer: i for i, layer in enumerate(LAYERS)}, ROOT: len(LAYERS)}


def module_name(path):
    parts = ["course_utils", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    """{module name: path} of every module of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module):
    """The layer of ``course_utils.<layer>.…``; modules directly in the package are the root."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in ORDER):
        return ROOT
    return parts[1] if parts[1] in ORDER else None


def imports_of(name, path, known):
    """The course modules ``name`` imports (anywhere in the file), resolved to module names in ``known``."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "course_utils")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "course_utils":
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {m for m in found if m != name}


def import_graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def violations(graph, layer=layer_of):
    """(upward imports, import circles) of ``graph`` ({module: imported modules})."""
    upward = sorted(f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, targets in graph.items() for b in targets
                    if b in graph and ORDER[layer(b)] > ORDER[layer(a)])
    return upward, circles(graph)


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_is_in_a_layer():
    strays = [m for m in modules() if layer_of(m) is None]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"
    roots = sorted(m for m in modules() if layer_of(m) == ROOT)
    assert roots == ["course_utils", "course_utils.check", "course_utils.layers"], roots


def test_no_upward_import_and_no_circle():
    upward, found = violations(import_graph())
    assert not upward, "upward imports:\n" + "\n".join(upward)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_graph_is_read_from_function_level_imports_too():
    graph = import_graph()
    # course_utils.check imports its self-checks inside functions only
    assert "course_utils.tooling.selfcheck" in graph["course_utils.check"]
    # a relative `from ..pictures import banks, layouts` names two modules
    assert {"course_utils.pictures.banks", "course_utils.pictures.layouts"} <= graph["course_utils.exercises.ch04"]


@pytest.mark.parametrize("planted", ["upward", "circle", "upward in a function"])
def test_the_check_fails_on_a_planted_bad_graph(planted, tmp_path):
    graph = import_graph()
    if planted == "upward":  # a kernel importing its caller, as the old self-checks did
        graph["course_utils.kernels.flash_fwd"] = graph["course_utils.kernels.flash_fwd"] | {
            "course_utils.api.attention"}
        upward, found = violations(graph)
        assert upward == ["course_utils.kernels.flash_fwd (kernels) imports course_utils.api.attention (api)"]
    elif planted == "circle":  # two modules of one layer importing each other
        graph["course_utils.kernels.tiles"] = graph["course_utils.kernels.tiles"] | {"course_utils.kernels.flash_fwd"}
        upward, found = violations(graph)
        assert not upward and any({"course_utils.kernels.tiles", "course_utils.kernels.flash_fwd"} <= set(c)
                                  for c in found), found
    else:  # read from a file: an import inside a function is found
        path = tmp_path / "bad.py"
        path.write_text("def f():\n    from ..api.attention import flash_attention\n    return flash_attention\n")
        targets = imports_of("course_utils.core.bad", path, modules())
        assert targets == {"course_utils.api.attention"}
        graph["course_utils.core.bad"] = targets
        upward, _ = violations(graph)
        assert upward == ["course_utils.core.bad (core) imports course_utils.api.attention (api)"]


def test_kernel_and_api_modules_have_no_main():
    """Self-checks are rows of ``course_utils.check.CHECKS``, not ``__main__`` blocks that import upward."""
    with_main = [name for name, path in modules().items() if layer_of(name) in ("core", "kernels", "api")
                 and '__name__ == "__main__"' in path.read_text()]
    assert not with_main, with_main
