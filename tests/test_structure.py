"""The package's import graph: no import circles, no import from a lower layer up to a higher one, no private name
imported from another module. Read from the source with ast (imports inside functions and
``importlib.import_module("...")`` strings count). ``python tests/test_structure.py`` prints the measures."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "basis_lite"

# Layers, lowest first: a module may import its own layer and the ones below, never one above.
LAYERS = [
    # contracts and helpers that import nothing of the package's but each other
    {"errors", "faults", "safeio", "model.downloads", "data.tasks", "data.example", "rewards.answers", "estimators.trajectory_layout", "export.converter",
     "config.fields", "rewards", "model", "rl", "runs", "export"},
    # torch-free configuration: estimator and loss specs, the config tree
    {"estimators", "estimators.basis_options", "estimators.probe_options", "losses", "config.keys", "config"},
    # numerics: losses, estimators' functions, data, rewards
    {"losses.policy", "estimators.base", "estimators.simple", "estimators.basis_blocks", "estimators.basis",
     "estimators.probe", "estimators.poise", "estimators.basis_mix", "data", "data.example", "data.rows", "data.loading", "data.prompts", "data.sampler",
     "rewards.scorer", "rewards.worker", "runs.metrics", "plot"},
    # model loading, engines, distributed, updates, checkpoints, export
    {"model.loading", "model.unsloth", "engines", "engines.base", "engines.hf", "engines.seeded", "engines.trajectory",
     "engines.vllm", "engines.vllm_weights", "engines.fast_cpu", "rl.distributed", "rl.update", "runs.checkpoint", "plan", "export.check", "rl.step", "runs.folder", "model.dtypes",
     "engines.eapo"},
    # assembly
    {"runtime", "rl.evaluate", "rl.priors", "runs.saved", "rl.state", "trainer", "export.hf", "export.gguf"},
    {"cli", "__main__", "__init__"},
]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".") if mod != "__init__" else []
    if level:
        base = base if is_pkg else base[:-1]
        base = base[:len(base) - (level - 1)] if level > 1 else base
    else:
        if not name or not (name == "basis_lite" or name.startswith("basis_lite.")):
            return ""
        base, name = [], name[len("basis_lite"):].lstrip(".")
    return ".".join(base + ([name] if name else []))


def imports(mods: dict[str, Path]) -> dict[str, set]:
    """module -> the package modules it imports (anywhere in the file), plus private names it imports."""
    graph: dict[str, set] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                tgt = _resolve(mod, is_pkg, node.level, node.module)
                if tgt == "" and node.level == 0:
                    continue
                for a in node.names:
                    sub = f"{tgt}.{a.name}" if tgt else a.name
                    targets.append(sub if sub in mods else tgt)
            elif isinstance(node, ast.Import):
                targets = [_resolve(mod, is_pkg, 0, a.name) for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) ==
                  "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [_resolve(mod, is_pkg, 0, str(node.args[0].value))]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("basis_lite.") and ":" in node.value:
                targets = [_resolve(mod, is_pkg, 0, node.value.split(":")[0])]  # "module:function" strings
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def private_imports(mods: dict[str, Path]) -> list[str]:
    out = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("basis_lite")):
                out += [f"{mod} <- {node.module or '.'}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(mod: str) -> int:
    for i, layer in enumerate(LAYERS):
        if mod in layer:
            return i
    return -1


def upward(graph: dict[str, set]) -> list[str]:
    return sorted(f"{a} -> {b}" for a in graph for b in graph[a]
                  if layer_of(a) >= 0 and layer_of(b) > layer_of(a) and not b.startswith(a.split(".")[0] + "."))


def longest_functions(mods: dict[str, Path], k: int = 8) -> list[tuple[int, str]]:
    out = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{mod}.{node.name}"))
    return sorted(out, reverse=True)[:k]


def test_no_import_circles():
    assert cycles(imports(modules())) == []


def test_every_module_has_a_layer_and_none_imports_upward():
    mods = modules()
    assert [m for m in mods if layer_of(m) < 0] == []
    assert upward(imports(mods)) == []


def test_no_private_name_imported_across_modules():
    assert private_imports(modules()) == []


if __name__ == "__main__":
    mods = modules()
    g = imports(mods)
    print("modules:", len(mods))
    print("import circles:", cycles(g))
    print("upward imports:", upward(g))
    print("unlayered:", [m for m in mods if layer_of(m) < 0])
    print("private imports:", private_imports(mods))
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in mods.items()), reverse=True)[:8]
    print("largest modules:", sizes)
    print("longest functions:", longest_functions(mods))


def test_every_estimator_is_bound_by_its_decorator_and_config_needs_no_torch():
    import subprocess
    import sys

    from basis_lite.estimators import estimator_names, get_estimator
    from basis_lite.estimators.base import bound_function

    for name in estimator_names():
        fn = get_estimator(name).function()
        assert fn is bound_function(name) and fn.__module__.startswith("basis_lite.estimators.")
    code = ("import sys, basis_lite.config as c; c.load_config('smoke', ['loss_type=grpo']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True)
    assert out.stdout.strip() == "False"
