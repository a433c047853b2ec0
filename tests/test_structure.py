"""The import graph of the package and of bench/: no import circles (the package and bench/ together), no import from
a lower layer up to a higher one, no private name imported from another module (bench/ included), the torch-free
layers free of torch at import, bench/lib importing no bench script, and a tests/<sub-package>/ folder for every
sub-package. Read from the source with ast (imports inside functions and ``importlib.import_module("...")`` strings
count; imports under ``if TYPE_CHECKING:`` do not, they never run). ``python tests/test_structure.py`` prints the
measures."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "basis_lite"
BENCH = REPO / "bench"

# Layers, lowest first, each listed by sub-package ("" = the package's top-level modules; "__init__" = the
# sub-package's own __init__.py). A module may import its own layer and the ones below, never one above; within
# one sub-package the order is free (its __init__ may import its function modules lazily), circles never are.
LAYERS = [
    ("contracts", "import nothing of the package's but each other", {
        "": ["errors", "faults", "safeio"],
        "config": ["fields"],
        "data": ["tasks", "example", "formats"],
        "rewards": ["__init__", "answers"],
        "model": ["__init__", "cpu", "downloads"],
        "estimators": ["trajectory_layout"],
        "rl": ["__init__"],
        "runs": ["__init__"],
        "export": ["__init__", "converter"],
    }),
    ("configuration", "torch-free: the config tree, the estimator, loss, engine and optimizer specs", {
        "config": ["__init__", "keys", "trl"],
        "estimators": ["__init__", "basis_options", "probe_options", "reference_options"],
        "losses": ["__init__"],
        "engines": ["__init__"],
        "rl": ["optimizers"],
    }),
    ("numerics", "losses, the estimators' functions, data, rewards, metrics", {
        "": ["plot"],
        "losses": ["policy"],
        "estimators": ["base", "simple", "basis_blocks", "basis", "probe", "poise", "basis_mix", "astar", "spo"],
        "data": ["__init__", "rows", "loading", "prompts", "sampler"],
        "rewards": ["scorer", "worker"],
        "runs": ["metrics"],
        "model": ["shape", "lora"],
    }),
    ("models and engines", "model loading, engines, distributed, updates, checkpoints, export checks", {
        "": ["plan"],
        "model": ["loading", "unsloth", "dtypes"],
        "engines": ["base", "hf", "seeded", "trajectory", "vllm", "vllm_weights", "fast_cpu", "eapo"],
        "rl": ["distributed", "update", "step", "guard"],
        "runs": ["checkpoint", "folder"],
        "export": ["check"],
    }),
    ("assembly", "the runtime, the trainer, evaluation, priors, saved runs, exporters", {
        "": ["runtime", "trainer"],
        "rl": ["evaluate", "priors", "state"],
        "runs": ["saved"],
        "export": ["hf", "gguf"],
    }),
    ("entry points", "the CLI", {
        "": ["cli", "__main__", "__init__"],
    }),
]
TORCH_FREE = ("contracts", "configuration")  # importing one of their modules imports no torch


def _key(sub: str, name: str) -> str:
    """The graph's name of a module listed in LAYERS: "config.keys", "config" (its __init__), "cli", "__init__"."""
    if not sub:
        return name
    return sub if name == "__init__" else f"{sub}.{name}"


LAYER_OF = {_key(sub, name): i for i, (_, _, subs) in enumerate(LAYERS) for sub, names in subs.items()
            for name in names}


# ---- reading the sources -------------------------------------------------------------------------------------------

def _tree(root: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__" and (len(parts) > 1 or prefix):
            parts = parts[:-1]
        out[".".join([prefix, *parts] if prefix else parts) or prefix] = p
    return out


def modules() -> dict[str, Path]:
    """The package's modules: "config.keys", "config" (its __init__), "cli", "__init__" (the package's)."""
    return _tree(PKG, "")


def bench_modules() -> dict[str, Path]:
    """bench/'s modules, results excluded: "bench", "bench.cpu_step", "bench.lib", "bench.lib.flops", ..."""
    return {k: p for k, p in _tree(BENCH, "bench").items() if "results" not in p.relative_to(BENCH).parts}


def subpackages() -> list[str]:
    return sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())


def _absolute(dotted: str) -> str | None:
    """The graph's name of an absolutely imported module: basis_lite.x -> "x", basis_lite -> "__init__",
    bench.x -> "bench.x"; None for anything else."""
    if dotted == "basis_lite":
        return "__init__"
    if dotted.startswith("basis_lite."):
        return dotted[len("basis_lite."):]
    if dotted == "bench" or dotted.startswith("bench."):
        return dotted
    return None


def _dotted(mod: str) -> str:
    if mod.startswith("bench"):
        return mod
    return "basis_lite" if mod == "__init__" else f"basis_lite.{mod}"


def _base(mod: str, path: Path, node: ast.ImportFrom, scripts: set[str]) -> str | None:
    """The module an ImportFrom reads from, as a graph name (None outside the package and bench/)."""
    if node.level:
        parts = _dotted(mod).split(".")
        parts = parts if path.name == "__init__.py" else parts[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        return _absolute(".".join(parts + ([node.module] if node.module else [])))
    name = node.module or ""
    if mod.startswith("bench") and name.split(".")[0] in scripts:  # a script run from bench/ imports a sibling
        return f"bench.{name}"
    return _absolute(name)


def _known(name: str | None, mods: dict) -> str | None:
    """The longest prefix of `name` that is a module of `mods`."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _nodes(tree: ast.AST, at_import: bool):
    """Every node of a module that can run: none of an `if TYPE_CHECKING:` block (imports there only name types for
    annotations); with at_import, only those that run when it is imported (no function bodies either)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        todo += list(ast.iter_child_nodes(node))


def imports(mods: dict[str, Path], at_import: bool = False) -> dict[str, set]:
    """module -> the modules of `mods` it imports: anywhere in the file but an `if TYPE_CHECKING:` block, or
    (at_import) when it is imported."""
    scripts = {p.stem for p in BENCH.glob("*.py")}
    graph: dict[str, set] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in _nodes(ast.parse(path.read_text()), at_import):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = _base(mod, path, node, scripts)
                targets = [_known(f"{base}.{a.name}", mods) or _known(base, mods) for a in node.names] if base else []
            elif isinstance(node, ast.Import):
                for a in node.names:
                    first = a.name.split(".")[0]
                    name = f"bench.{a.name}" if mod.startswith("bench") and first in scripts else _absolute(a.name)
                    targets.append(_known(name, mods))
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) ==
                  "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
                targets = [_known(_absolute(str(node.args[0].value)), mods)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("basis_lite.") and ":" in node.value and not at_import:
                targets = [_known(_absolute(node.value.split(":")[0]), mods)]  # "module:function" strings
            graph[mod].update(t for t in targets if t and t != mod)
    return graph


def private_imports(mods: dict[str, Path]) -> list[str]:
    """`from <a module of mods> import _name` anywhere: a private name used outside the module that owns it."""
    scripts = {p.stem for p in BENCH.glob("*.py")}
    out = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and _known(_base(mod, path, node, scripts), mods):
                out += [f"{mod} <- {node.module or '.'}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def imports_torch(path: Path) -> bool:
    """The module runs `import torch` (or `from torch ...`) when it is imported."""
    return any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "torch")
               for n in _nodes(ast.parse(path.read_text()), at_import=True))


def torch_chain(mod: str, mods: dict[str, Path], at_import: dict[str, set]) -> list[str]:
    """The chain of imports run when `mod` is imported, from `mod` to a module that imports torch ([] if none)."""
    seen, stack = {mod}, [(mod, [mod])]
    while stack:
        m, chain = stack.pop()
        if imports_torch(mods[m]):
            return chain
        for n in sorted(at_import[m]):
            if n not in seen:
                seen.add(n)
                stack.append((n, chain + [n]))
    return []


def bench_layering(graph: dict[str, set]) -> list[str]:
    """Imports against bench/'s two layers: the package imports nothing of bench/, bench/lib imports no script."""
    def is_bench(m):
        return m == "bench" or m.startswith("bench.")

    def is_lib(m):
        return m == "bench.lib" or m.startswith("bench.lib.")

    return sorted(f"{a} -> {b}" for a in graph for b in graph[a]
                  if (not is_bench(a) and is_bench(b)) or (is_lib(a) and is_bench(b) and not is_lib(b)))


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
    return LAYER_OF.get(mod, -1)


def upward(graph: dict[str, set]) -> list[str]:
    return sorted(f"{a} -> {b}" for a in graph for b in graph[a]
                  if layer_of(a) >= 0 and layer_of(b) > layer_of(a) and not b.startswith(a.split(".")[0] + "."))


def longest_chain(graph: dict[str, set], starts=None) -> list[str]:
    """The longest import chain from one of `starts` (default: any module) in a graph without circles: how many
    levels of modules sit on each other."""
    memo: dict[str, list[str]] = {}

    def chain(v):
        if v not in memo:
            memo[v] = [v] + max((chain(w) for w in sorted(graph[v])), key=len, default=[])
        return memo[v]

    return max((chain(v) for v in sorted(starts or graph)), key=len, default=[])


def longest_functions(mods: dict[str, Path], k: int = 8) -> list[tuple[int, str]]:
    out = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{mod}.{node.name}"))
    return sorted(out, reverse=True)[:k]


def largest_modules(mods: dict[str, Path], k: int = 8) -> list[tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), m) for m, p in mods.items()), reverse=True)[:k]


# ---- the rules -----------------------------------------------------------------------------------------------------

def test_no_import_circles_in_the_package_and_bench():
    assert cycles(imports({**modules(), **bench_modules()})) == []


def test_every_module_has_a_layer_and_none_imports_upward():
    mods = modules()
    assert [m for m in mods if layer_of(m) < 0] == []
    assert sorted(m for m in LAYER_OF if m not in mods) == []  # the table names no module that is gone
    assert upward(imports(mods)) == []


def test_imports_under_type_checking_do_not_count_but_those_in_functions_and_its_else_branch_do(tmp_path):
    (tmp_path / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .trainer import A\n"
                                   "else:\n    from .runtime import B\ndef f():\n    from .cli import C\n")
    mods = {**modules(), "m": tmp_path / "m.py"}
    assert imports(mods)["m"] == {"runtime", "cli"} and imports(mods, at_import=True)["m"] == {"runtime"}


def test_layers_are_listed_by_sub_package():
    subs = {sub for _, _, by_sub in LAYERS for sub in by_sub} - {""}
    assert sorted(subs) == subpackages()


def test_no_private_name_imported_across_modules():
    assert private_imports({**modules(), **bench_modules()}) == []


def test_the_package_imports_nothing_of_bench_and_bench_lib_no_script():
    assert bench_layering(imports({**modules(), **bench_modules()})) == []


def test_torch_free_layers_import_no_torch():
    """Importing a module of a torch-free layer runs no `import torch`, through any chain of module-level imports
    (the parents of a sub-package module run too: basis_lite/__init__ and the sub-package's __init__)."""
    mods = modules()
    at_import = imports(mods, at_import=True)
    for m in mods:  # importing a.b runs basis_lite/__init__ and a/__init__ first
        at_import[m] |= {p for p in ("__init__", m.split(".")[0]) if p in mods and p != m}
    free = [m for m in mods if LAYERS[layer_of(m)][0] in TORCH_FREE]
    assert free and {m: chain for m in free if (chain := torch_chain(m, mods, at_import))} == {}


def test_every_sub_package_has_its_tests():
    missing = [s for s in subpackages() if not list((REPO / "tests" / s).glob("test_*.py"))]
    assert missing == [], f"sub-packages without a tests/<sub-package>/test_*.py: {missing}"


def test_the_checker_sees_bench_imports_and_their_private_names(tmp_path, monkeypatch):
    """The rules on a throw-away bench/: imports of bench.lib and of a sibling script by its bare name count, a
    private name imported from bench.lib is found, and so are the circle through them and bench.lib importing a
    script."""
    bench = tmp_path / "bench"
    (bench / "lib").mkdir(parents=True)
    (bench / "__init__.py").write_text("")
    (bench / "lib" / "__init__.py").write_text("")
    (bench / "lib" / "shared.py").write_text("def _helper():\n    from bench import a\n")
    (bench / "a.py").write_text("from bench.lib.shared import _helper\nimport b\n")
    (bench / "b.py").write_text("def f():\n    import a\n    from basis_lite.config import load_config\n")
    monkeypatch.setattr(f"{__name__}.BENCH", bench)
    mods = {**modules(), **bench_modules()}
    graph = imports(mods)
    assert graph["bench.a"] == {"bench.lib.shared", "bench.b"} and graph["bench.b"] == {"bench.a", "config"}
    assert cycles(graph) == [["bench.a", "bench.b", "bench.lib.shared"]]
    assert private_imports(mods) == ["bench.a <- bench.lib.shared._helper"]
    assert bench_layering(graph) == ["bench.lib.shared -> bench.a"]


if __name__ == "__main__":
    mods, bench = modules(), bench_modules()
    g = imports({**mods, **bench})
    pkg_graph = {m: {t for t in g[m] if t in mods} for m in mods}
    print("modules:", len(mods), "in the package,", len(bench), "in bench/")
    print("import circles:", cycles(g))
    print("upward imports:", upward(pkg_graph))
    print("unlayered:", [m for m in mods if layer_of(m) < 0])
    print("private imports:", private_imports({**mods, **bench}))
    print("import levels (layers, lowest first):",
          ", ".join(f"{name} {sum(1 for m in mods if layer_of(m) == i)}" for i, (name, _, _) in enumerate(LAYERS)))
    if not cycles(g):
        for label, starts in (("package", mods), ("bench", bench)):
            chain = longest_chain(g, starts)
            print(f"longest import chain from {label}: {len(chain)} modules: {' -> '.join(chain)}")
    print("largest modules:", largest_modules(mods))
    print("largest bench modules:", largest_modules(bench))
    print("longest functions:", longest_functions(mods))
    print("longest bench functions:", longest_functions(bench))


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
