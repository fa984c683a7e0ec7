"""The layout's rules (docs/ARCHITECTURE.md), checked on the source tree.

- The core imports no pass: below the passes nothing imports picofx.passes, the planner or the CLI;
  picofx/__init__.py imports the passes and then the planner as its last imports.
- No import cycles; imports run down the layers: cli -> planner -> passes -> the public face (api,
  rules, testing) -> runtime -> manager, compression, report_html -> parallel -> cost, rewrite,
  kernels -> capture, models -> errors.
- Process groups and device meshes are made and resolved in picofx/parallel/ only; pass declarations
  are read through `pass_info`, never probed (`getattr(p, "communicates")`); graph meta keys are
  named constants, never `meta["picofx_..."]` literals; no module imports another's private names.
- Pass families are independent: nothing in picofx/passes/X imports picofx/passes/Y (nor the
  picofx.passes package), at the top or inside a function. What several families share lives below
  them (picofx/parallel/, picofx/cost/); a pass that needs another declares it (`requires`).
- picofx/ has at most 8 top-level modules and at least 4 subpackages; no module is over 400 lines.
- A run's layout is described once: the planner's Layout (picofx/planner/layouts.py); no other class
  is named Layout or has fields for the data-parallel, tp and pp degrees.

Each rule is also run on a small tree that breaks it, so a rule that stopped seeing its breach fails.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"picofx": "picofx"}  # folder -> the package it is installed as
LINE_FOLDERS = ("picofx", "examples", "tools", "tests")
MAX_TOP_LEVEL_MODULES, MIN_SUBPACKAGES, MAX_LINES = 8, 4, 400


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for picofx/ under `root` (a package by its __init__.py)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


@dataclass
class Import:
    """One import of a picofx module."""
    statement: ast.stmt
    module: str
    taken: list[str]    # the names `from module import a, b` takes
    bound: str | None   # the local name the module itself is bound to


def imports(name: str, tree: ast.Module, is_package: bool, known: dict[str, Path]) -> list[Import]:
    """Every import of a known module, anywhere in the file (a function-level import is a
    dependency too). `from package import sub` imports the submodule; the parent packages that
    Python runs first are not counted."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(node, a.name, [], a.asname) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            taken = []
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.append(Import(node, f"{base}.{alias.name}", [], alias.asname or alias.name))
                else:
                    taken.append(alias.name)
            if taken and base in known:
                found.append(Import(node, base, taken, None))
    return found


def parsed(root: Path) -> dict[str, tuple[Path, ast.Module, list[Import]]]:
    known = modules(root)
    result = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        result[name] = path, tree, imports(name, tree, path.name == "__init__.py", known)
    return result


def import_graph(root: Path) -> nx.DiGraph:
    graph = nx.DiGraph()
    for name, (_, _, found) in parsed(root).items():
        graph.add_node(name)
        graph.add_edges_from((name, i.module) for i in found if i.module != name)
    return graph


def cycles(root: Path) -> list[list[str]]:
    """Each cycle of imports, starting from its first module by name."""
    found = [c[c.index(min(c)):] + c[:c.index(min(c))] for c in nx.simple_cycles(import_graph(root))]
    return sorted(found)


ABOVE_THE_CORE = ("picofx.passes", "picofx.planner", "picofx.cli", "picofx.__main__")  # they compose passes


def is_pass(module: str) -> bool:
    """A pass, or what sits above the passes and composes them."""
    return any(module == top or module.startswith(top + ".") for top in ABOVE_THE_CORE)


def core_imports_of_passes(root: Path) -> list[str]:
    """Imports of a pass (or the planner, the CLI) by the core; picofx/__init__.py's last top-level
    imports may be such, once the core's are done."""
    problems = []
    for name, (path, tree, found) in parsed(root).items():
        if is_pass(name):
            continue
        top_level = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
        imported = {id(i.statement): i.module for i in found}
        tail = top_level[next((k for k, s in enumerate(top_level) if is_pass(imported.get(id(s), ""))), len(top_level)):]
        for i in found:
            allowed = name == "picofx" and all(is_pass(imported.get(id(s), "")) for s in tail) and i.statement in tail
            if is_pass(i.module) and not allowed:
                problems.append(f"{path.relative_to(root)}:{i.statement.lineno} imports {i.module}")
    return problems


def private_imports(root: Path) -> list[str]:
    """`from picofx.x import _name`, and `x._name` where x is a picofx module bound by an import."""
    problems = []
    for name, (path, tree, found) in parsed(root).items():
        where = path.relative_to(root)
        others = [i for i in found if i.module != name]
        problems += [f"{where}:{i.statement.lineno} imports {i.module}.{t}"
                     for i in others for t in i.taken if _private(t)]
        bound = {i.bound for i in others if i.bound}
        problems += [f"{where}:{node.lineno} uses {node.value.id}.{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id in bound and _private(node.attr)]
    return problems


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def family_of(module: str) -> str | None:
    """The pass family a module belongs to (picofx.passes.<family>...), None outside one."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["picofx", "passes"] and len(parts) > 2 else None


def family_problems(root: Path) -> list[str]:
    """Imports from one pass family into another (or into picofx.passes, which imports every family)."""
    problems = []
    for name, (path, _, found) in parsed(root).items():
        family = family_of(name)
        if family is None:
            continue
        for i in found:
            if i.module == "picofx.passes" or family_of(i.module) not in (None, family):
                problems.append(f"{path.relative_to(root)}:{i.statement.lineno} imports {i.module}, "
                                f"outside pass family {family!r}")
    return problems


# Dependencies run down this list (a module may import its own layer and the layers below).
LAYERS = {"picofx.errors": 0, "picofx.capture": 1, "picofx.models": 1, "picofx.cost": 2, "picofx.rewrite": 2,
          "picofx.kernels": 2, "picofx.parallel": 3, "picofx.manager": 4, "picofx.compression": 4,
          "picofx.report_html": 4, "picofx.runtime": 5, "picofx.passes": 7, "picofx.planner": 8, "picofx.cli": 9,
          "picofx.__main__": 9}
PUBLIC_FACE = 6  # picofx/__init__.py and the other top-level modules (api, rules, testing)


def layer(module: str) -> int:
    return next((rank for prefix, rank in LAYERS.items() if module == prefix or module.startswith(prefix + ".")),
                PUBLIC_FACE)


def layer_problems(root: Path) -> list[str]:
    """Imports that climb the layers (the pass import of picofx/__init__.py is the other rule's)."""
    return [f"{a} imports {b}, a layer above it" for a, b in sorted(import_graph(root).edges)
            if layer(b) > layer(a) and not (a == "picofx" and is_pass(b))]


def size_problems(root: Path) -> list[str]:
    core = root / "picofx"
    top_level = sorted(p.name for p in core.glob("*.py"))
    subpackages = sorted(p.name for p in core.iterdir() if (p / "__init__.py").is_file())
    problems = []
    if len(top_level) > MAX_TOP_LEVEL_MODULES:
        problems.append(f"picofx/ has {len(top_level)} top-level modules (at most {MAX_TOP_LEVEL_MODULES}): "
                        f"{', '.join(top_level)}")
    if len(subpackages) < MIN_SUBPACKAGES:
        problems.append(f"picofx/ has {len(subpackages)} subpackages (at least {MIN_SUBPACKAGES})")
    for folder in LINE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else []:
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                problems.append(f"{path.relative_to(root)} has {lines} lines (at most {MAX_LINES})")
    return problems



# ---- the tree as it is ------------------------------------------------------------------------

def test_the_core_imports_no_pass():
    assert core_imports_of_passes(ROOT) == []
    assert import_graph(ROOT).has_edge("picofx", "picofx.passes")  # the one allowed import is seen


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert cycles(ROOT) == []
    # The graph is the real one: the dependencies the layout rests on are in it.
    assert graph.has_edge("picofx.passes.checkpoint.checkpoint", "picofx.cost.model")
    assert graph.has_edge("picofx.runtime.compile", "picofx.cost.partition")
    assert graph.has_edge("picofx.kernels.rms_norm", "picofx.kernels.triton_rms_norm")  # a function-level import


GROUP_MAKERS = {"new_group", "init_device_mesh", "init_process_group", "get_group", "DeviceMesh", "WORLD"}
DECLARATIONS = {"stage", "communicates", "splits_graph", "microbatches", "measure", "measures", "plans_partition",
                "mesh_dims", "capture_inputs", "after_measured_step"}


def _calls_named(tree: ast.Module, names: set[str]):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            yield node
        elif isinstance(node, ast.Name) and node.id in names:
            yield node


def parallel_problems(root: Path) -> list[str]:
    """Process groups made or resolved outside picofx/parallel/; declarations probed by attribute;
    `meta["picofx_..."]` literals outside the modules that name those keys."""
    problems = []
    for name, (path, tree, _) in parsed(root).items():
        where = path.relative_to(root)
        if not name.startswith("picofx.parallel"):
            problems += [f"{where}:{n.lineno} resolves a process group ({getattr(n, 'attr', getattr(n, 'id', ''))})"
                         for n in _calls_named(tree, GROUP_MAKERS)]
        for node in ast.walk(tree):
            if (name != "picofx.manager.passes" and isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in DECLARATIONS):
                problems.append(f"{where}:{node.lineno} probes {node.args[1].value!r}; read pass_info(p)")
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "meta":
                key = node.slice
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "meta" and node.args):
                key = node.args[0]
            if isinstance(key, ast.Constant) and str(key.value).startswith("picofx_"):
                problems.append(f"{where}:{node.lineno} reads meta[{key.value!r}]; use the named key")
    return problems


def test_pass_families_import_no_other_family():
    assert family_problems(ROOT) == []  # and the imports are seen: a family's own modules import each other
    assert import_graph(ROOT).has_edge("picofx.passes.shard.shard", "picofx.passes.shard.reduce")


THE_LAYOUT = "picofx/planner/layouts.py"
DEGREES = ({"dp", "dp_replicate", "dp_shard"}, {"tp"}, {"pp"})  # a second layout holds one field of each


def second_layouts(root: Path) -> list[str]:
    """Classes other than the planner's Layout that describe a run's layout: named Layout, or with
    annotated fields for the data-parallel, tensor-parallel and pipeline degrees."""
    found = []
    for path in sorted((root / "picofx").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
            fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if where != THE_LAYOUT and (node.name == "Layout" or all(fields & names for names in DEGREES)):
                found.append(f"{where}:{node.lineno} class {node.name} describes a run's layout again: use "
                             f"picofx.planner.layouts.Layout (one description of the run)")
    return found


def test_a_runs_layout_is_described_once():
    assert second_layouts(ROOT) == []


def test_dependencies_run_down_the_layers():
    assert layer_problems(ROOT) == []


def test_process_groups_declarations_and_meta_keys_go_through_the_parallel_layer():
    assert parallel_problems(ROOT) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(ROOT) == []


def test_few_top_level_modules_several_subpackages_short_files():
    assert size_problems(ROOT) == []


def test_import_picofx_makes_the_public_names_available():
    names = ["passes.Checkpoint", "passes.Fuse", "passes.Precision", "plan", "planner.predict.fit_step", "rules.Rule",
             "device.calibrate", "BudgetError", "optimize"]
    code = f"import picofx; print(sorted(picofx.manager.PASSES)); print([picofx.{', picofx.'.join(names)}])"
    # A fresh interpreter: nothing imported before `import picofx` (outside the source tree).
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stderr
    assert {"checkpoint", "fuse", "precision"} <= set(ast.literal_eval(result.stdout.splitlines()[0]))


# ---- each rule sees its breach ----------------------------------------------------------------

GOOD_TREE = {
    "picofx/__init__.py": "from picofx.api import run\nfrom picofx import passes\n",
    "picofx/api.py": "from picofx.cost import model\n\ndef run():\n    return model.predict()\n",
    "picofx/cost/__init__.py": "",
    "picofx/cost/model.py": "from .units import GiB\n\ndef predict():\n    return GiB\n",
    "picofx/cost/units.py": "GiB = 2**30\n_internal = 1\n",
    "picofx/capture/__init__.py": "",
    "picofx/manager/__init__.py": "REGISTRY = {}\n",
    "picofx/runtime/__init__.py": "from picofx.cost.model import predict\n",
    "picofx/passes/__init__.py": "from picofx.passes.one import One\n",
    "picofx/passes/one.py": "from picofx.manager import REGISTRY\nfrom picofx.cost.model import predict\n\nclass One:\n    pass\n",
}

BREACHES = {
    "core imports a pass": ({"picofx/api.py": "from picofx.passes.one import One\n"},
                            core_imports_of_passes, "picofx/api.py:1 imports picofx.passes.one"),
    "core imports a pass in a function": ({"picofx/cost/units.py": "def f():\n    from picofx.passes import one\n"},
                                          core_imports_of_passes, "picofx/cost/units.py:2 imports picofx.passes.one"),
    "__init__ imports the passes early": ({"picofx/__init__.py": "from picofx import passes\nfrom picofx import api\n"},
                                          core_imports_of_passes, "picofx/__init__.py:1 imports picofx.passes"),
    "a cycle": ({"picofx/cost/units.py": "from picofx.runtime import predict\n"},
                lambda root: [" -> ".join(c) for c in cycles(root)], "picofx.cost.model -> picofx.cost.units"),
    "a relative-import cycle": ({"picofx/cost/units.py": "from . import model\n"},
                                lambda root: [" -> ".join(c) for c in cycles(root)], "model -> picofx.cost.units"),
    "a climbing import": ({"picofx/cost/units.py": "from picofx.manager import REGISTRY\n"},
                          layer_problems, "picofx.cost.units imports picofx.manager, a layer above it"),
    "a group made outside parallel/": ({"picofx/runtime/__init__.py": "import torch.distributed as dist\n"
                                                                         "g = dist.new_group([0, 1])\n"},
                                       parallel_problems, "picofx/runtime/__init__.py:2 resolves a process group"),
    "a probed declaration": ({"picofx/api.py": "def f(p):\n    return getattr(p, 'communicates', False)\n"},
                             parallel_problems, "picofx/api.py:2 probes 'communicates'"),
    "a meta key literal": ({"picofx/passes/one.py": "def f(gm):\n    return gm.meta.get('picofx_overlap')\n"},
                           parallel_problems, "picofx/passes/one.py:2 reads meta['picofx_overlap']"),
    "a private name": ({"picofx/api.py": "from picofx.cost.units import _internal\n"},
                       private_imports, "picofx/api.py:1 imports picofx.cost.units._internal"),
    "a private attribute": ({"picofx/passes/one.py": "from picofx.cost import units as u\nx = u._internal\n"},
                            private_imports, "picofx/passes/one.py:2 uses u._internal"),
    "too many modules": ({f"picofx/m{i}.py": "" for i in range(8)}, size_problems, "10 top-level modules"),
    "too few subpackages": ({"picofx/capture/__init__.py": None, "picofx/runtime/__init__.py": None},
                            size_problems, "3 subpackages"),
    "a pass imports another family": ({"picofx/passes/two/__init__.py": "",
                                       "picofx/passes/two/two.py": "from picofx.passes.one import One\n"},
                                      family_problems, "picofx/passes/two/two.py:1 imports picofx.passes.one"),
    "a pass imports another family in a function": (
        {"picofx/passes/two/__init__.py": "", "picofx/passes/two/two.py": "def f():\n    from picofx import passes\n"},
        family_problems, "picofx/passes/two/two.py:2 imports picofx.passes, outside pass family 'two'"),
    "a long module": ({"picofx/cost/units.py": "GiB = 2**30\n" * 401}, size_problems, "units.py has 401 lines"),
    "a second Layout": ({"picofx/api.py": "class Layout:\n    cp: int = 1\n"}, second_layouts,
                        "picofx/api.py:1 class Layout describes a run's layout again"),
    "a layout by its fields": ({"picofx/cost/units.py": "class Ranks:\n    dp_shard: int\n    tp: int\n    pp: int\n"},
                               second_layouts, "picofx/cost/units.py:1 class Ranks describes"),
}


def write_tree(root: Path, files: dict[str, str | None]) -> Path:
    for name, text in files.items():
        path = root / name
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return root


def test_a_tree_that_keeps_the_rules_passes(tmp_path):
    root = write_tree(tmp_path, GOOD_TREE)
    checks = (core_imports_of_passes, cycles, layer_problems, private_imports, size_problems, parallel_problems,
              family_problems, second_layouts)
    assert [check(root) for check in checks] == [[]] * len(checks)
    assert set(import_graph(root).edges) == {
        ("picofx", "picofx.api"), ("picofx", "picofx.passes"), ("picofx.api", "picofx.cost.model"),
        ("picofx.cost.model", "picofx.cost.units"), ("picofx.runtime", "picofx.cost.model"),
        ("picofx.passes", "picofx.passes.one"), ("picofx.passes.one", "picofx.manager"),
        ("picofx.passes.one", "picofx.cost.model")}


@pytest.mark.parametrize("breach", list(BREACHES))
def test_each_rule_sees_its_breach(tmp_path, breach):
    changes, check, expected = BREACHES[breach]
    root = write_tree(write_tree(tmp_path, GOOD_TREE), changes)
    problems = check(root)
    assert any(expected in p for p in problems), problems
