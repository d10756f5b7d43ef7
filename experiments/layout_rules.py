"""kvquant's structure figures and layout rules, computed from the source (docs/layout.md states them):

    python experiments/layout_rules.py            # the figures, in words (and the function-size distribution)
    python experiments/layout_rules.py --check    # exit 1 naming each breach that is not a listed debt, and each
                                                  # listed debt that is gone or smaller than listed
    python experiments/layout_rules.py --render   # rewrites docs/layout.md's figures between its markers
    python experiments/layout_rules.py --package OTHER/kvquant   # another checkout's figures (before/after)

What is read: every ``kvquant/**/*.py`` parsed with :mod:`ast` (nothing imported or run). An import is every
``import`` / ``from ... import`` statement anywhere in a file: at the top, inside a function (a lazy import is still
an import), and under ``if TYPE_CHECKING:`` (a type named in an annotation is a dependency: moving or renaming it
breaks the annotation; such imports are marked ``[type]`` in the listings). A name imported from a package's
``__init__.py`` counts as an import of the file that defines it, where ``__init__.py`` only hands it on.

- **arrows**: file -> file; a **room** is a top-level file of the package or one of its folders (as docs/layout.md
  draws it). **Floors**: a room stands above everything it imports; where rooms import each other in a loop, the
  order inside the loop is the one whose arrows back up carry the fewest imported names (exact, over every order;
  ties: fewest names imported at module level, then by name). The arrows left running from a lower floor to a
  higher one are the **upward imports**.
- **cycles**: files that import each other in a loop (the strongly connected components of the file graph).
- **module size**: lines per ``.py`` file (limit :data:`MODULE_LINES`); **function size**: lines from ``def`` to the
  function's last line, nested functions counted on their own too (limit :data:`FUNCTION_LINES`).
- **private symbols**: outside ``compat/``, an import of an underscore name (or through an underscore module) of
  transformers or lm-eval, or an attribute / ``getattr`` string naming one of the private names ``compat/`` wraps
  (``_tp_size``, ``_rank``, ...) that kvquant does not define itself.
- **commands**: no module imports ``run.py``, ``plan.py``, ``lm_eval.py``, ``export.py`` or ``adopt.py``;
  **transformers.cache_utils**: imported only under ``cache/``.
- **one meaning per name**: a public class or function defined at the top of two modules of the package is a breach
  (a method is not: one that overrides another is the same meaning), but for :data:`PROTOCOL_NAMES`, each with its
  reason.

A breach listed in :data:`DEBTS` (to be removed) or :data:`EXCEPTIONS` (kept, with the reason) is reported but
accepted at exactly the listed size: a new breach, a larger one, and a debt that shrank or is gone (so its entry
must shrink too) all fail ``--check`` and tests/test_layout_rules.py.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 500
#: docs/layout.md's limit; of the package's ~1,200 functions (2026-12-06) the median is 7 lines, the 99th
#: percentile 44 and the longest outside the Triton kernel's module 58: 60 flags only outliers
FUNCTION_LINES = 60
PRIVATE_PACKAGES = ("transformers", "lm_eval")
COMMANDS = ("run.py", "plan.py", "lm_eval.py", "export.py", "adopt.py")
BEGIN = "<!-- figures: python experiments/layout_rules.py --render -->"
END = "<!-- end of figures -->"

#: breaches the restructure of issue 54 is to remove, each at its size today (names imported up; files in a cycle):
#: none left since 2026-12-06 (the last, formats/ -> cache/kernels.py, went with the kernel's move into formats/)
DEBTS: dict[tuple[str, str], int] = {}
#: breaches kept on purpose (docs/layout.md says why): the Triton kernel and its launch cannot call back into Python
EXCEPTIONS = {
    ("function size", "kvquant/cache/triton_attend.py:_attend_kernel"): 94,
    ("function size", "kvquant/cache/triton_attend.py:_stream_args"): 76,
    ("function size", "kvquant/cache/triton_attend.py:attend"): 68,
}
#: public names several modules define on purpose, one protocol each, with the reason (the one-meaning rule skips them)
PROTOCOL_NAMES = {
    "main": "each command's entry point (`python -m kvquant.X`, `kvquant X`): argv in, exit code out",
}


@dataclass(frozen=True)
class Import:
    """One import statement's tie to one file of the package (a statement naming several files is several)."""
    importer: str  #: the importing file, e.g. ``kvquant/scoring/session.py``
    line: int
    target: str  #: the imported file
    names: tuple[str, ...]  #: the names it takes (a plain ``import a.b`` takes one: the module)
    lazy: bool  #: inside a function
    typing_only: bool  #: under ``if TYPE_CHECKING:``


@dataclass(frozen=True)
class External:
    """One name taken from outside the package: ``from transformers.cache_utils import Cache`` is
    ``module="transformers.cache_utils", name="Cache"``; ``import transformers`` has ``name=""``."""
    importer: str
    line: int
    module: str
    name: str


@dataclass
class Source:
    """One parsed file of the package."""
    path: str
    module: str
    text: str
    tree: ast.Module
    #: names this module hands on from another module of the package at its top level: name -> (module, name)
    hands_on: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Breach:
    rule: str
    where: str
    size: int = 1  #: lines for a size rule, imported names for an upward import, files for a cycle
    detail: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.rule, self.where


def statements(body: list[ast.stmt], in_function: bool = False, typing_only: bool = False, prefix: str = ""):
    """Every statement under ``body``, nested ones too, as ``(statement, in_function, typing_only, prefix)``:
    whether it sits in a function, under ``if TYPE_CHECKING:``, and the qualified name of what encloses it
    (``Class.method.``). Expressions are not entered: imports and definitions are statements."""
    for node in body:
        yield node, in_function, typing_only, prefix
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = in_function or not isinstance(node, ast.ClassDef)
            yield from statements(node.body, inner, typing_only, f"{prefix}{node.name}.")
            continue
        guarded = isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for name, value in ast.iter_fields(node):
            if isinstance(value, list):
                for child in value:
                    if isinstance(child, ast.stmt):
                        yield from statements([child], in_function, typing_only or (guarded and name == "body"),
                                              prefix)
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        yield from statements(child.body, in_function, typing_only, prefix)


def read_package(package_dir: Path) -> dict[str, Source]:
    """Every ``.py`` file under ``package_dir``, parsed, by module name."""
    base = package_dir.parent
    sources = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(base).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        text = path.read_text()
        sources[module] = Source(path.relative_to(base).as_posix(), module, text, ast.parse(text, str(path)))
    for source in sources.values():
        for node in source.tree.body:
            if isinstance(node, ast.ImportFrom):
                origin = _absolute(source, node)
                if origin in sources:
                    for alias in node.names:
                        source.hands_on[alias.asname or alias.name] = (origin, alias.name)
    return sources


def _absolute(source: Source, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative levels resolved against ``source``'s package."""
    if not node.level:
        return node.module or ""
    package = source.module.split(".")
    if not source.path.endswith("__init__.py"):
        package = package[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def _defining(sources: dict[str, Source], module: str, name: str) -> str:
    """The module that defines ``name`` taken from ``module``: through a package's ``__init__.py`` that only hands it
    on, the module it comes from."""
    seen = set()
    while sources[module].path.endswith("__init__.py") and name in sources[module].hands_on and module not in seen:
        seen.add(module)
        module, name = sources[module].hands_on[name]
    return module


def imports(sources: dict[str, Source]) -> tuple[list[Import], list[External]]:
    """Every import of every file: ties between files of the package, and names taken from outside it."""
    inside, outside = [], []
    for source in sources.values():
        for node, lazy, typing_only, _ in statements(source.tree.body):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets: dict[str, list[str]] = defaultdict(list)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in sources:
                        targets[alias.name].append(alias.asname or alias.name)
                    else:
                        outside.append(External(source.path, node.lineno, alias.name, ""))
            else:
                origin = _absolute(source, node)
                for alias in node.names:
                    if f"{origin}.{alias.name}" in sources:
                        targets[f"{origin}.{alias.name}"].append(alias.name)
                    elif origin in sources:
                        targets[_defining(sources, origin, alias.name)].append(alias.name)
                    else:
                        outside.append(External(source.path, node.lineno, origin, alias.name))
            inside += [Import(source.path, node.lineno, sources[target].path, tuple(names), lazy, typing_only)
                       for target, names in targets.items()]
    return inside, outside


def room(path: str) -> str:
    """The room ``path`` stands in: the package's folder it is under (``kvquant/cache/``), or itself at the top."""
    parts = path.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else path


@dataclass
class Structure:
    """The package's import graph and what is derived from it."""
    sources: dict[str, Source]
    imports: list[Import]
    external: list[External]
    files: nx.DiGraph  #: file -> file, each arrow's ``imports`` the list of :class:`Import`
    rooms: nx.DiGraph  #: room -> room, likewise
    floors: dict[str, int]  #: room -> floor (1 = ground)
    upward: list[tuple[str, str]]  #: room arrows from a lower floor to a higher one
    cycles: list[list[str]]  #: files in a loop, each list sorted, the lists by size then name


def _names(ties: list[Import]) -> int:
    return sum(len(tie.names) for tie in ties)


def _order(graph: nx.DiGraph, nodes: set[str]) -> list[str]:
    """``nodes`` (rooms importing each other in a loop) from the ground up, in the order whose arrows back up carry
    the fewest imported names, then the fewest imported at module level: exact, by dynamic programming over subsets
    (2^n n^2; the loops here have a handful of rooms)."""
    order = sorted(nodes)
    if len(order) > 16:
        raise ValueError(f"{len(order)} rooms import each other in one loop: too many to order exactly")

    def cost(below: int, node: str) -> tuple[int, int]:
        ties = [tie for i, other in enumerate(order) if below >> i & 1 and graph.has_edge(other, node)
                for tie in graph.edges[other, node]["imports"]]
        return _names(ties), _names([tie for tie in ties if not tie.lazy])

    best: dict[int, tuple[tuple[int, int], list[str]]] = {0: ((0, 0), [])}
    for size in range(len(order)):
        for below in [s for s in best if bin(s).count("1") == size]:
            (names, eager), placed = best[below]
            for i, node in enumerate(order):
                if below >> i & 1:
                    continue
                extra = cost(below, node)
                candidate = ((names + extra[0], eager + extra[1]), placed + [node])
                whole = below | 1 << i
                if whole not in best or candidate < best[whole]:
                    best[whole] = candidate
    return best[(1 << len(order)) - 1][1]


def structure(package_dir: Path) -> Structure:
    """``package_dir``'s import graph of files and of rooms, its floors, upward imports and cycles."""
    sources = read_package(package_dir)
    ties, external = imports(sources)
    files, rooms = nx.DiGraph(), nx.DiGraph()
    files.add_nodes_from(source.path for source in sources.values())
    rooms.add_nodes_from(room(source.path) for source in sources.values())
    for tie in ties:
        for graph, a, b in ((files, tie.importer, tie.target), (rooms, room(tie.importer), room(tie.target))):
            if a != b:
                if not graph.has_edge(a, b):
                    graph.add_edge(a, b, imports=[])
                graph.edges[a, b]["imports"].append(tie)
    upward = []
    for loop in nx.strongly_connected_components(rooms):
        order = _order(rooms, loop)
        upward += [(a, b) for a, b in itertools.combinations(order, 2) if rooms.has_edge(a, b)]
    ground = rooms.copy()
    ground.remove_edges_from(upward)
    floors: dict[str, int] = {}
    for node in reversed(list(nx.lexicographical_topological_sort(ground))):
        floors[node] = 1 + max((floors[b] for b in ground.successors(node)), default=0)
    cycles = sorted((sorted(c) for c in nx.strongly_connected_components(files) if len(c) > 1),
                    key=lambda c: (len(c), c))
    return Structure(sources, ties, external, files, rooms, floors, sorted(upward), cycles)


def _tie_text(ties: list[Import]) -> str:
    return "; ".join(_tie_names(tie) for tie in ties)


def _tie_names(tie: Import) -> str:
    """``tie``'s names, marked ``[type]`` under ``if TYPE_CHECKING:`` and ``[lazy]`` inside a function."""
    marks = [mark for mark, on in (("type", tie.typing_only), ("lazy", tie.lazy)) if on]
    return ", ".join(tie.names) + "".join(f" [{mark}]" for mark in marks)


def _private_names(sources: list[Source]) -> set[str]:
    """The underscore names ``sources`` (the compat modules) use: imported, as attributes, or as strings."""
    names = set()
    for source in sources:
        for node in ast.walk(source.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {p for p in node.module.split(".") if p.startswith("_")}
                names |= {a.name for a in node.names if a.name.startswith("_")}
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return {n for n in names if re.fullmatch(r"_[A-Za-z]\w*", n) and not n.endswith("__")}


def private_uses(found: Structure, compat: str) -> list[Breach]:
    """transformers / lm-eval private names used outside the ``compat`` folder (see the module's docstring): the
    names ``compat`` wraps, less those the rest of the package defines itself (functions, classes, assigned names
    and attributes, parameters: ``store._rank`` of kvquant's own)."""
    wrapped = _private_names([s for s in found.sources.values() if s.path.startswith(compat)])
    own, uses = set(), []
    for source in found.sources.values():
        if source.path.startswith(compat):
            continue
        for node in ast.walk(source.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Store):
                    own.add(node.attr)
                uses.append((source.path, node.lineno, node.attr))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in wrapped:
                uses.append((source.path, node.lineno, node.value))
    breaches = [Breach("private symbol", f"{path}:{line} {name}") for path, line, name in uses
                if name in wrapped - own]
    for ext in found.external:
        private = [p for p in ext.module.split(".") + [ext.name] if p.startswith("_") and not p.endswith("__")]
        if ext.module.split(".")[0] in PRIVATE_PACKAGES and private and not ext.importer.startswith(compat):
            breaches.append(Breach("private symbol", f"{ext.importer}:{ext.line} {ext.module}.{ext.name}".rstrip(".")))
    return breaches


def functions(found: Structure) -> list[tuple[int, str]]:
    """Every function's lines and ``path:qualified.name``, nested ones too."""
    return [(node.end_lineno - node.lineno + 1, f"{source.path}:{prefix}{node.name}")
            for source in found.sources.values() for node, _, _, prefix in statements(source.tree.body)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def breaches(found: Structure) -> list[Breach]:
    """Every breach of the layout rules in ``found``, listed or not."""
    package = next(iter(found.sources.values())).path.split("/")[0]
    out = [Breach("cycle", " ".join(cycle), len(cycle), "; ".join(
        f"{a} -> {b}: {_tie_text(found.files.edges[a, b]['imports'])}" for a in cycle for b in cycle
        if found.files.has_edge(a, b))) for cycle in found.cycles]
    for a, b in found.upward:
        ties = found.rooms.edges[a, b]["imports"]
        out.append(Breach("upward import", f"{a} -> {b}", _names(ties),
                          f"floor {found.floors[a]} -> {found.floors[b]}, {len({(t.importer, t.line) for t in ties})}"
                          " import lines: " + "; ".join(f"{t.importer}:{t.line} {_tie_names(t)}" for t in ties)))
    out += [Breach("module size", s.path, len(s.text.splitlines())) for s in found.sources.values()
            if len(s.text.splitlines()) > MODULE_LINES]
    out += [Breach("function size", where, lines) for lines, where in functions(found) if lines > FUNCTION_LINES]
    out += private_uses(found, f"{package}/compat/")
    commands = {f"{package}/{name}" for name in COMMANDS}
    out += [Breach("command imported", f"{t.importer}:{t.line} {t.target}") for t in found.imports
            if t.target in commands]
    out += [Breach("transformers.cache_utils outside cache/", f"{e.importer}:{e.line}") for e in found.external
            if e.module.startswith("transformers.cache_utils") and not e.importer.startswith(f"{package}/cache/")]
    out += [Breach("name defined twice", name, len(places), ", ".join(places))
            for name, places in sorted(public_definitions(found).items()) if len(places) > 1
            and name not in PROTOCOL_NAMES]
    return out


def public_definitions(found: Structure) -> dict[str, list[str]]:
    """Every public class and function defined at a module's top level (under a top-level ``if`` or ``try`` too, not
    in a class or function), by name: the ``path:line`` of each definition."""
    places = defaultdict(list)
    for source in found.sources.values():
        for node, in_function, _, prefix in statements(source.tree.body):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not in_function
                    and not prefix and not node.name.startswith("_")):
                places[node.name].append(f"{source.path}:{node.lineno}")
    return places


def judge(found: list[Breach], listed: dict[tuple[str, str], int]) -> list[str]:
    """What fails: each breach not listed or larger than listed, each listed one that is gone or smaller."""
    problems = []
    by_key = {b.key: b for b in found}
    for b in found:
        detail = f": {b.detail}" if b.detail else ""
        if b.key not in listed:
            problems.append(f"{b.rule}: {b.where} ({b.size}){detail}")
        elif b.size > listed[b.key]:
            problems.append(f"{b.rule}: {b.where} grew from {listed[b.key]} to {b.size}{detail}")
    for key, size in listed.items():
        if key not in by_key:
            problems.append(f"listed but gone (remove it from the list): {key[0]}: {key[1]}")
        elif by_key[key].size < size:
            problems.append(f"listed at {size} but now {by_key[key].size} (lower the list): {key[0]}: {key[1]}")
    return problems


def figures(found: Structure) -> str:
    """The figures section of docs/layout.md (markdown), from ``found``."""
    def count(a_room: str, b_room: str) -> str:
        ties = found.rooms.edges[a_room, b_room]["imports"] if found.rooms.has_edge(a_room, b_room) else []
        return f"{_names(ties)} names in {len({(t.importer, t.line) for t in ties})} import lines"

    package = next(iter(found.sources.values())).path.split("/")[0]
    listed = breaches(found)
    lines = [
        "| | count |", "|---|---:|",
        f"| files (`.py`) | {len(found.sources)} |",
        f"| rooms (a folder drawn as one) | {found.rooms.number_of_nodes()} |",
        f"| floors | {max(found.floors.values())} |",
        f"| arrows between rooms | {found.rooms.number_of_edges()} |",
        f"| arrows between files | {found.files.number_of_edges()} |",
        f"| room arrows that run back up | {len(found.upward)} |",
        f"| cycles between files | {len(found.cycles)} |",
        f"| `scoring` -> `runner` | {count(f'{package}/scoring/', f'{package}/runner/')} |",
        f"| `runner` -> `scoring` | {count(f'{package}/runner/', f'{package}/scoring/')} |",
        "", "Floors, from the top (a room stands above what it imports, but for the arrows back up):", "",
    ]
    for floor in sorted(set(found.floors.values()), reverse=True):
        rooms = sorted(r for r, f in found.floors.items() if f == floor)
        lines.append(f"- {floor}: " + ", ".join(f"`{r.removeprefix(package + '/')}`" for r in rooms))
    lines += ["", "Every breach of the rules, each a listed debt (to be removed) or exception (kept on purpose);",
              "`--check` and tests/test_layout_rules.py fail on any other, and on a listed one that is gone:", ""]
    for b in sorted(listed, key=lambda b: b.key):
        kind = "debt" if b.key in DEBTS else "exception" if b.key in EXCEPTIONS else "NOT LISTED"
        unit = {"cycle": "file", "upward import": "name", "name defined twice": "module"}.get(b.rule, "line")
        unit += "s" if b.size != 1 else ""
        lines.append(f"- {kind}, {b.rule}: `{b.where}` ({b.size} {unit})" + (f"; {b.detail}" if b.detail else ""))
    defined = public_definitions(found)
    lines += ["", "Public names defined in several modules on purpose (one protocol each; any other name defined",
              "twice is a breach):", ""]
    lines += [f"- `{name}` ({len(defined.get(name, []))} modules): {reason}" for name, reason in PROTOCOL_NAMES.items()]
    return "\n".join(lines)


def render(doc: Path, text: str) -> str:
    """``doc``'s text with ``text`` between :data:`BEGIN` and :data:`END` (ValueError where it lacks them)."""
    old = doc.read_text()
    if old.count(BEGIN) != 1 or old.count(END) != 1:
        raise ValueError(f"{doc}: needs one {BEGIN!r} and one {END!r}")
    head, rest = old.split(BEGIN)
    return f"{head}{BEGIN}\n{text}\n{END}{rest.split(END)[1]}"


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, exit 2, as kvquant.errors' parser gives (not imported: it would import torch)."""

    def error(self, message: str):
        self.exit(2, f"layout_rules: error: {' '.join(message.split())} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 naming each breach not listed")
    parser.add_argument("--render", action="store_true", help="rewrite docs/layout.md's figures section")
    parser.add_argument("--package", type=Path, help="another checkout's kvquant/ folder (figures and --check; "
                        "e.g. a worktree of an older commit)")
    args = parser.parse_args(argv)
    if args.render and args.package:
        parser.error("--render writes this checkout's docs/layout.md, from this checkout's package: no --package")
    package = args.package or ROOT / "kvquant"
    if not (package / "__init__.py").is_file():
        parser.error(f"{package} is no package folder (it holds no __init__.py)")
    found = structure(package)
    if args.render:
        from kvquant.fs import write_file  # imported here: the figures and --check need no torch

        doc = ROOT / "docs" / "layout.md"
        try:
            write_file(doc, render(doc, figures(found)))
        except ValueError as err:
            parser.error(str(err))
    if args.check:
        problems = judge(breaches(found), {**DEBTS, **EXCEPTIONS})
        print("\n".join(problems) or "layout rules: no breach but the listed ones")
        return 1 if problems else 0
    if not args.render:
        print(figures(found))
        sizes = sorted(lines for lines, _ in functions(found))
        print(f"\nfunction sizes ({len(sizes)} functions): median {sizes[len(sizes) // 2]}, 90th percentile "
              f"{sizes[len(sizes) * 9 // 10]}, 99th {sizes[len(sizes) * 99 // 100]}, longest {sizes[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
