"""The rank table of the product (agent, power, partition, kernels) and its two checks, by the AST of every
file (imports inside functions too; only ``if TYPE_CHECKING:`` blocks are skipped, they never run):

- every import from one layer into another points to a strictly lower rank (two layers of the same rank
  never import each other); a few layers may be imported only by the modules named for them;
- no import cycle between product files (Tarjan's strongly connected components over the file graph; a
  package ``__init__`` wiring its own children is not a cycle).

The allow-list is empty on purpose: a new arrow either fits the table or the table (and
docs/ARCHITECTURE.md, which shows it) changes. Each module takes the rank of the longest prefix in
``RANKS``; a module no prefix covers fails the test, so a new package gets a place before it lands. A
package ``__init__`` that re-exports its children sits at the highest rank of what it re-exports (its
importers get that code)."""
from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "power", "partition", "kernels")

# Lowest first. Same rank: neither may import the other. Longest prefix wins.
RANKS: dict[str, int] = {
    # the kernels: plain-PyTorch references and the GPU kernels beside them (one layer)
    "kernels": 0,
    # the board's files and its physics, lowest first (power/__init__.py says why); physics is what the
    # model's offload planner may use, and it imports nothing from partition (the ranks above say so)
    "power": 1, "power.hw": 1,
    "power.physics": 2,
    # model data without torch: shapes and presets, default paths, the quantised-checkpoint format
    "partition": 3, "partition.config": 3, "partition.paths": 3, "partition.quant_format": 3,
    # the model and how it runs
    "partition.model": 4,
    "partition.gguf": 5,
    "partition.tokenizer": 6, "partition.checkpoint": 6, "partition.slices": 6,
    "partition.quantize": 7,
    "partition.runners": 8,
    "partition.exits": 9,           # the heads, their runtime and the text splits they read
    "partition.build": 10,
    "partition.trt": 11,
    "partition.runners.backend_choice": 12, "partition.runners.ort_decoder_runner": 12,
    "partition.runners.chain_loader": 13,
    "partition.offload": 14,
    "partition.exits.calibrate": 14, "partition.exits.corpus": 14,    # these run the loaded chain
    # the board's control, above everything the model needs from it
    "power.policy": 15,
    "power.twin": 16,
    "power.runtime": 17,
    "power.bench": 18,
    # the product a user runs
    "agent": 19, "agent.phases": 19,
    "agent.engine": 20,
    "agent.config": 21, "agent.metrics": 21, "agent.sdnotify": 21,
    "agent.api": 22,
    "agent.chat": 23, "agent.model_load": 23,
    "agent.service": 24, "agent.smoke": 24,
    "agent.demo": 25, "agent.benchmark": 25,
    "agent.cli": 26,
    "agent.boot": 27, "agent.__main__": 28,
}

# Layers only the named modules (prefixes) may import, whatever their rank: the energy benchmark is for the
# bench CLI and its drivers, never the service.
ONLY_FROM: dict[str, tuple[str, ...]] = {
    "power.bench": ("power.bench", "agent.cli.bench", "agent.benchmark"),
}

ALLOWED: set[tuple[str, str]] = set()       # (importer, imported): empty, and it stays empty


def _modules() -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[mod.removesuffix(".__init__")] = path
    return files


MODULES = _modules()


def _imported(mod: str, path: Path) -> set[str]:
    """Every name an import statement of ``path`` brings in (relative imports resolved), nested too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _file_of(name: str) -> str | None:
    """The product module an imported name lives in (``partition.config.PRESETS`` -> ``partition.config``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@lru_cache(maxsize=None)
def graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(f for n in _imported(m, p) if (f := _file_of(n)) and f != m) for m, p in MODULES.items()}


def layer(mod: str) -> str | None:
    """The longest prefix of ``RANKS`` that covers ``mod``."""
    best = None
    for prefix in RANKS:
        if (mod == prefix or mod.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def _own_child(mod: str, dep: str) -> bool:
    return MODULES[mod].name == "__init__.py" and dep.startswith(mod + ".")


@lru_cache(maxsize=None)
def rank(mod: str) -> int:
    """The table's rank; a package __init__ at the highest rank of the children it re-exports."""
    lay = layer(mod)
    assert lay is not None, f"{mod}: no prefix of RANKS covers it (give it a rank in tests/test_architecture_ranks.py)"
    own = [rank(d) for d in graph()[mod] if _own_child(mod, d)]
    return max([RANKS[lay], *own])


def breaks(g: dict[str, frozenset[str]]) -> list[str]:
    """Every import across layers that does not point down, and every import of a layer kept for others."""
    out = []
    for mod, deps in sorted(g.items()):
        for dep in sorted(deps):
            if (mod, dep) in ALLOWED or _own_child(mod, dep):
                continue
            if layer(mod) != layer(dep) and rank(dep) >= rank(mod):
                out.append(f"{mod} (rank {rank(mod)}, {layer(mod)}) imports {dep} (rank {rank(dep)}, {layer(dep)})")
            for kept, users in ONLY_FROM.items():
                if (dep == kept or dep.startswith(kept + ".")) and not any(
                        mod == u or mod.startswith(u + ".") for u in users):
                    out.append(f"{mod} imports {dep}: only {', '.join(users)} may")
    return out


def cycles(g: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), leaving out a package __init__ and
    the children it wires (an __init__ importing its children, who import a sibling through it)."""
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)

    def wiring(comp: list[str]) -> bool:
        return all(any(o.startswith(x + ".") or x.startswith(o + ".") for o in comp if o != x) for x in comp)
    return [c for c in found if not wiring(c)]


def test_every_module_has_a_rank() -> None:
    assert [m for m in MODULES if layer(m) is None] == []


def test_imports_point_down_the_ranks() -> None:
    assert breaks(graph()) == []


def test_no_import_cycle_between_product_files() -> None:
    assert cycles(graph()) == []


def test_the_allow_list_is_empty() -> None:
    assert ALLOWED == set()


def test_docs_architecture_shows_this_table() -> None:
    """docs/ARCHITECTURE.md's rank table is this one (a package root that shares its first layer's rank,
    `power` say, goes without saying)."""
    import re

    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    shown: dict[str, int] = {}
    for ranks, layers in re.findall(r"^\| ([\d, ]+) \| (.+?) \| .+ \|$", doc, re.M):
        nums = [int(x) for x in ranks.split(",")]
        for i, name in enumerate(re.findall(r"`([\w.]+)`", layers)):
            shown[name] = nums[min(i, len(nums) - 1)]
    implied = {k for k, v in RANKS.items()
               if "." not in k and any(o.startswith(k + ".") and RANKS[o] == v for o in RANKS)}
    assert shown == {k: v for k, v in RANKS.items() if k not in implied}


# -- the checks themselves catch what they are for -----------------------------------------------------

def _with(extra: dict[str, set[str]]) -> dict[str, frozenset[str]]:
    g = dict(graph())
    for mod, deps in extra.items():
        g[mod] = g[mod] | frozenset(deps)
    return g


@pytest.mark.parametrize(("mod", "dep"), [
    ("power.hw.backends", "power.twin.runner"),             # hardware importing the simulator above it
    ("power.hw.gpu", "power.policy.profiles"),              # hardware importing the policy
    ("power.physics.costmodel", "partition.config"),        # physics taking a preset name
    ("partition.offload.planner", "power.policy.dvfs"),     # offload reaching above power.physics
    ("power.runtime.controller", "agent.phases"),           # power importing the product
    ("agent.engine.core", "agent.service"),                 # the engine importing its composition root
    ("kernels.kv_quant", "partition.model"),                # the kernels importing the model
])
def test_an_upward_import_is_a_break(mod: str, dep: str) -> None:
    new = set(breaks(_with({mod: {dep}}))) - set(breaks(graph()))
    assert [b for b in new if b.startswith(f"{mod} ")] == [
        f"{mod} (rank {rank(mod)}, {layer(mod)}) imports {dep} (rank {rank(dep)}, {layer(dep)})"]


def test_the_energy_bench_is_the_bench_clis_alone() -> None:
    new = set(breaks(_with({"agent.service": {"power.bench.energy"}}))) - set(breaks(graph()))
    assert new == {"agent.service imports power.bench.energy: only power.bench, agent.cli.bench, agent.benchmark may"}


def test_a_cycle_is_found() -> None:
    new = [c for c in cycles(_with({"kernels.kv_quant": {"kernels.kv_triton"}})) if c not in cycles(graph())]
    assert new == [["kernels.kv_quant", "kernels.kv_triton"]]
