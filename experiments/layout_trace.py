"""Follow one parameter of one function through the package's calls, read from the source (nothing is run):

    python experiments/layout_trace.py kvquant/scoring/session.py:Session.measure:candidate
    python experiments/layout_trace.py kvquant/cache/build.py:make_cache:quantizer --stops 200

In a function, the names that carry the parameter are the parameter and every name assigned (or looped over) from
an expression that mentions one of them; a call that passes such a name (``f(x)``, ``f(x.spec)``,
``f(key=[x])``), also inside a lambda, hands it on to the callee's parameter in that place. The callee is found
statically: a function or class of the module (a class: its ``__init__``), a name imported from the package (through
a package's ``__init__.py`` to the module that defines it), ``module.function`` of an imported module, and
``self.method`` / ``cls.method`` of the enclosing class. Anything else (a method of another object, a parameter
that holds a function, ``*args`` / ``**kwargs``) is where the trace loses the parameter: it is listed, not guessed.

Printed: each call followed, as caller -> callee (parameter), with the floors of their rooms
(experiments/layout_rules.py's); then the files visited, the calls, the calls **back up** (into a room on a higher
floor than the caller's: possible only against the floors, through an upward import or a callback) and where the
trace was lost.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import sys
from dataclasses import dataclass, field
from pathlib import Path

from layout_rules import ROOT, Source, Structure, _absolute, _defining, room, statements, structure


@dataclass(frozen=True)
class Step:
    caller: str  #: ``path:qualified.name``
    callee: str
    param: str  #: the callee's parameter the traced value arrives as
    line: int  #: the call's line in the caller's file


@dataclass
class Trace:
    start: str
    param: str
    steps: list[Step] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  #: ``path:line call`` where the trace cannot follow
    kept: set[str] = field(default_factory=set)  #: the package's classes without ``__init__`` the value is kept in


def _functions(source: Source) -> dict[str, ast.FunctionDef]:
    return {f"{prefix}{node.name}": node for node, _, _, prefix in statements(source.tree.body)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


MUTATORS = frozenset({"append", "extend", "add", "update", "insert", "setdefault", "appendleft"})


def _names(expr: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(expr) if isinstance(node, ast.Name)}


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """``a, b = x, y`` as ``[(a, x), (b, y)]``; any other assignment as one pair."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return list(zip(target.elts, value.elts))
    return [(target, value)]


def _carriers(function: ast.FunctionDef, param: str) -> set[str]:
    """The names of ``function`` that carry ``param``: it, what is assigned or looped over from them, and a
    container one is put into (``out.append(x)``), to a fixed point (the order of the statements does not matter)."""
    carriers, grew = {param}, True
    while grew:
        before = len(carriers)
        for node in ast.walk(function):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                carriers |= {n for target in targets for t, v in _pairs(target, node.value)
                             if _names(v) & carriers for n in _names(t)}
            elif isinstance(node, (ast.For, ast.comprehension)) and _names(node.iter) & carriers:
                carriers |= _names(node.target)
            elif isinstance(node, ast.withitem) and node.optional_vars is not None and \
                    _names(node.context_expr) & carriers:
                carriers |= _names(node.optional_vars)
            elif _mutation(node) and any(_names(a) & carriers for a in node.args):
                carriers.add(node.func.value.id)
        grew = len(carriers) > before
    return carriers


def _mutation(node: ast.AST) -> bool:
    """Whether ``node`` is ``name.append(...)`` or another call that puts its arguments into a local container."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
        and isinstance(node.func.value, ast.Name)


@dataclass(frozen=True)
class Callee:
    """What a call runs: ``kind`` ``function`` (``where`` = ``path:qualified.name``; ``bound``: its first parameter
    is not passed), ``object`` (a class of the package without ``__init__``: the value is kept in one), ``outside``
    (a builtin, or a name from outside the package), ``unknown`` (a method of an object, a function a name holds)."""
    kind: str
    where: str = ""
    bound: bool = False


class _Resolver:
    """Which function of the package a call names, seen from one module."""

    def __init__(self, found: Structure):
        self.found = found
        self.by_path = {s.path: s for s in found.sources.values()}
        self.functions = {s.path: _functions(s) for s in found.sources.values()}
        self.classes = {s.path: {node.name for node in s.tree.body if isinstance(node, ast.ClassDef)}
                        for s in found.sources.values()}
        self.imported = {s.path: self._imported(s) for s in found.sources.values()}

    def _imported(self, source: Source) -> dict[str, tuple[str, str | None] | None]:
        """Local name -> (module, name in it; None for the module itself) for every import of ``source`` from the
        package; -> None for one from outside it."""
        names = {}
        for node, _, _, _ in statements(source.tree.body):
            if isinstance(node, ast.ImportFrom):
                origin = _absolute(source, node)
                for alias in node.names:
                    local = alias.asname or alias.name
                    if f"{origin}.{alias.name}" in self.found.sources:
                        names[local] = (f"{origin}.{alias.name}", None)
                    elif origin in self.found.sources:
                        names[local] = (_defining(self.found.sources, origin, alias.name), alias.name)
                    else:
                        names[local] = None
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    inside = alias.asname and alias.name in self.found.sources
                    names[alias.asname or alias.name.split(".")[0]] = (alias.name, None) if inside else None
        return names

    def _definition(self, path: str, name: str) -> Callee | None:
        """``path:name``: a function, a class's ``__init__``, or a class without one."""
        if name in self.functions[path]:
            return Callee("function", f"{path}:{name}")
        if f"{name}.__init__" in self.functions[path]:
            return Callee("function", f"{path}:{name}.__init__", bound=True)
        if name in self.classes[path]:
            return Callee("object", name)
        return None

    def callee(self, path: str, qualname: str, call: ast.Call) -> Callee:
        """What ``call``, in ``path``'s function ``qualname``, runs."""
        imported, func = self.imported[path], call.func
        if isinstance(func, ast.Name):
            found = self._definition(path, func.id)
            if found is None and imported.get(func.id):
                module, name = imported[func.id]
                found = self._definition(self.found.sources[module].path, name) if name else None
            outside = func.id in vars(builtins) or (func.id in imported and imported[func.id] is None)
            return found or Callee("outside" if outside else "unknown")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Constant):
            return Callee("outside")  # ", ".join(...)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and "." in qualname:
                found = self._definition(path, f"{qualname.split('.')[0]}.{func.attr}")
                return Callee("function", found.where, True) if found and found.kind == "function" else \
                    Callee("unknown")
            if imported.get(owner):  # module.function, or Class.method of an imported class
                module, name = imported[owner]
                place = self.found.sources[module].path
                found = self._definition(place, f"{name}.{func.attr}" if name else func.attr)
                return Callee("function", found.where, bool(name)) if found and found.kind == "function" else \
                    Callee("unknown")
            if owner in self.classes[path]:
                found = self._definition(path, f"{owner}.{func.attr}")
                return Callee("function", found.where, True) if found and found.kind == "function" else \
                    Callee("unknown")
            if owner in imported and imported[owner] is None:
                return Callee("outside")
        return Callee("unknown")


def _parameter(function: ast.FunctionDef, bound: bool, position: int | None, keyword: str | None) -> str | None:
    """The parameter of ``function`` an argument at ``position`` (or named ``keyword``) arrives as, or None."""
    params = [a.arg for a in function.args.posonlyargs + function.args.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    if bound and not static:
        params = params[1:]
    if keyword is not None:
        names = params + [a.arg for a in function.args.kwonlyargs]
        return keyword if keyword in names else None
    return params[position] if position < len(params) else None


def trace(found: Structure, start: str, param: str, stops: int = 400) -> Trace:
    """Follow ``param`` of ``start`` (``path:qualified.name``) through the calls that hand it on, depth first in the
    order the code is written, each (function, parameter) once, at most ``stops`` calls."""
    resolver, out = _Resolver(found), Trace(start, param)
    seen, todo = set(), [(start, param)]
    while todo and len(out.steps) < stops:
        where, name = todo.pop()
        if (where, name) in seen:
            continue
        seen.add((where, name))
        path, qualname = where.split(":")
        function = resolver.functions[path][qualname]
        carriers = _carriers(function, name)
        handed = []
        for call in sorted((n for n in ast.walk(function) if isinstance(n, ast.Call) and not _mutation(n)),
                           key=lambda n: (n.lineno, n.col_offset)):
            places = [(i, None) for i, a in enumerate(call.args) if _names(a) & carriers] + \
                     [(None, k.arg) for k in call.keywords if _names(k.value) & carriers]
            target = resolver.callee(path, qualname, call) if places else Callee("outside")
            text = f"{path}:{call.lineno} {ast.unparse(call.func)}"
            if target.kind == "object":
                out.kept.add(target.where)
            elif target.kind == "unknown" and text not in out.lost:
                out.lost.append(text)
            if target.kind != "function":
                continue
            callee_path, callee_name = target.where.split(":")
            for position, keyword in places:
                starred = keyword is None and (position is None or isinstance(call.args[position], ast.Starred))
                arrives = None if starred else _parameter(
                    resolver.functions[callee_path][callee_name], target.bound, position, keyword)
                if arrives is None:
                    out.lost += [] if f"{text} (*args / **kwargs)" in out.lost else [f"{text} (*args / **kwargs)"]
                elif (target.where, arrives) not in seen and (target.where, arrives) not in handed:
                    out.steps.append(Step(where, target.where, arrives, call.lineno))
                    handed.append((target.where, arrives))
        todo += reversed(handed)
    return out


def report(found: Structure, result: Trace) -> str:
    """``result`` in words: each call site followed, with the parameters it hands on and the floors it goes between;
    then the files visited, the call sites, those back up a floor, what the value is kept in and where it is lost."""
    def floor(where: str) -> int:
        return found.floors[room(where.split(":")[0])]

    sites: dict[tuple[str, int, str], list[str]] = {}
    for s in result.steps:
        sites.setdefault((s.caller, s.line, s.callee), []).append(s.param)
    up = [site for site in sites if floor(site[2]) > floor(site[0])]
    lines = [f"`{result.param}` from {result.start} (floor {floor(result.start)})"]
    lines += [f"  {caller}:{line} -> {callee} ({', '.join(params)}), floor {floor(caller)} -> {floor(callee)}"
              + ("  BACK UP" if (caller, line, callee) in up else "")
              for (caller, line, callee), params in sites.items()]
    files = {result.start.split(":")[0]} | {s.callee.split(":")[0] for s in result.steps}
    lines += [f"files visited: {len(files)}; call sites followed: {len(sites)}; back up a floor: {len(up)}",
              f"kept in: {', '.join(sorted(result.kept)) or 'nothing'}",
              f"lost at ({len(result.lost)}): " + "; ".join(result.lost)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("start", help="FILE:FUNCTION:PARAM, e.g. kvquant/scoring/session.py:Session.measure:candidate")
    parser.add_argument("--stops", type=int, default=400, help="at most this many calls followed")
    parser.add_argument("--package", type=Path, default=ROOT / "kvquant",
                        help="another checkout's kvquant/ folder (e.g. a worktree of an older commit)")
    args = parser.parse_args(argv)
    if args.start.count(":") != 2:
        parser.error(f"{args.start!r} is not FILE:FUNCTION:PARAM")
    path, qualname, param = args.start.split(":")
    if not (args.package / "__init__.py").is_file():
        parser.error(f"{args.package} is no package folder (it holds no __init__.py)")
    found = structure(args.package)
    if qualname not in _Resolver(found).functions.get(path, {}):
        parser.error(f"no function {qualname} in {path}")
    print(report(found, trace(found, f"{path}:{qualname}", param, args.stops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
