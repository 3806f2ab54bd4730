#!/usr/bin/env python3
"""Fails on an import upward or in a cycle between the core's layers.

Reads every non-test `.rs` file under a crate's `src/`, collects the `crate::…` and
`super::…` paths it names (in `use` lines and inline), and maps each to the top-level unit it
lands in (a layer folder such as `providers/`, or a flat module such as `testing.rs`).

The layer order is the drawing in the crate doc of `lib.rs` (a ```text block, top layer
first, one layer a line: its unit's name, then two spaces and what it holds; indented lines
continue the one above). A unit may name only its own layer and the layers below it; a
unit the drawing does not place fails too, so a new module is given its place. Without a
drawing (small trees in the tests) only cycles are looked for.

Only the layers listed in `HOST_LAYERS` may name the `Host` trait (the others are pure, and
tested without one), and the worker may never name `RequestFilter` (a request's life is
the lifecycle's, above it).

The lifecycle's admission routes (each file of `lifecycle/` but its `mod.rs`, the
dispatcher, and the modules listed in `ROUTE_SHARED`) never call one another: a route returns
its outcome to the dispatcher, which takes the next step. A route (or a shared module) that
names another route's module (`super::lease::…`) or calls a function another route defines
(`self.admit_from_lease(…)`, `take_place(…)`) fails.

Cycles: strongly connected components of more than one unit in that graph, which layers
going downward only cannot have; and within each layer folder, between its modules.

The cycles still to be broken are listed in `scripts/layer_cycles.txt` (one per line, its
units sorted, space-separated): a cycle not in that list fails, and so does a listed one
that no longer exists (so the list only shrinks, and says what is left to do).

    scripts/check_layers.py [--src crates/core/src] [--known scripts/layer_cycles.txt]
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
USE_GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.S)
# Test code imports anything it tests; it is not a layer.
TEST_FILES = re.compile(r"(^|_)tests?\.rs$|^testing\.rs$")
TEST_MODULE = re.compile(r"^\s*#\[cfg\(test\)\]\s*\n\s*mod\s+\w+\s*\{", re.M)
DRAWING = re.compile(r"^//! ```text\n(.*?)^//! ```", re.M | re.S)
LAYER_LINE = re.compile(r"^//! ([a-z_]+(?:, [a-z_]+)*)(?:\s{2,}|$)")


# The layers whose code runs over the host; every other layer is plain data and logic.
HOST_LAYERS = {"effects", "worker", "lifecycle"}
HOST = re.compile(r"\bHost\b")

# The folder of admission routes, and its modules that are not routes: what every route
# shares (and may call), which calls no route either. Its `mod.rs` is the dispatcher.
ROUTE_FOLDER = "lifecycle"
ROUTE_SHARED = {"answer", "settle", "record"}
FREE_FN = re.compile(r"^(?:pub(?:\([a-z]+\))? )?fn ([a-z_][a-z0-9_]*)")
METHOD = re.compile(r"^    (?:pub(?:\([a-z]+\))? )?fn ([a-z_][a-z0-9_]*)")
REQUEST_FILTER = re.compile(r"\bRequestFilter\b")


def module_of(src: Path, file: Path) -> list[str]:
    """The module path of `file` (`providers/gemini.rs` -> ["providers", "gemini"])."""
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return parts


def code(text: str) -> str:
    """`text` without its test module and its comment lines."""
    cut = TEST_MODULE.search(text)
    if cut:
        text = text[: cut.start()]
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))


def paths(text: str, module: list[str]) -> set[tuple[str, ...]]:
    """The crate paths `text` (the file of `module`) names through `crate::`/`super::`."""
    text = code(text)
    found = set()
    for group in USE_GROUP.finditer(text):
        for item in re.split(r"[,\s]+", group.group(1)):
            segments = tuple(s for s in item.strip("{} ").split("::") if s)
            if segments and segments[0] != "self":
                found.add(segments)
    for match in PATH.finditer(text):
        segments = [s for s in match.group(2).split("::") if s and s != "{"]
        if match.group(1) == "super":
            base = module[:-1]
            while segments and segments[0] == "super":
                segments.pop(0)
                base = base[:-1]
            segments = base + segments
        if segments:
            found.add(tuple(segments))
    return found


def references(text: str, module: list[str]) -> set[str]:
    """The top-level units `text` (the file of `module`) names through `crate::`/`super::`."""
    return {path[0] for path in paths(text, module)}


def layer_files(src: Path):
    """(file, module path) of every non-test source file below lib.rs."""
    for file in sorted(src.rglob("*.rs")):
        if TEST_FILES.search(file.name) or file.name == "build.rs":
            continue
        module = module_of(src, file)
        if module:  # lib.rs: declares the units, imports none of them
            yield file, module


def graph(src: Path) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for file, module in layer_files(src):
        unit = module[0]
        units.setdefault(unit, set()).update(references(file.read_text(), module) - {unit})
    return {unit: {d for d in deps if d in units} for unit, deps in units.items()}


def folder_graph(src: Path, unit: str) -> dict[str, set[str]]:
    """Within layer folder `unit`, which of its modules name which (its mod.rs, the
    folder's own face, is not one of them)."""
    inner: dict[str, set[str]] = {}
    for file, module in layer_files(src):
        if module[0] != unit or len(module) < 2:
            continue
        named = {path[1] for path in paths(file.read_text(), module) if path[0] == unit and len(path) > 1}
        inner.setdefault(module[1], set()).update(named - {module[1]})
    return {name: {d for d in deps if d in inner} for name, deps in inner.items()}


def layers(src: Path) -> list[list[str]] | None:
    """The layers drawn in `lib.rs`'s crate doc, bottom first; None if there is no drawing."""
    lib = src / "lib.rs"
    drawing = DRAWING.search(lib.read_text()) if lib.exists() else None
    if not drawing:
        return None
    drawn = [LAYER_LINE.match(line) for line in drawing.group(1).splitlines()]
    return [m.group(1).split(", ") for m in reversed(drawn) if m]


def upward(edges: dict[str, set[str]], order: list[list[str]]) -> list[str]:
    """Imports of a layer above the importer's, and units the drawing does not place."""
    rank = {unit: level for level, units in enumerate(order) for unit in units}
    problems = [f"{unit}: not in the layers drawn in lib.rs; draw its place" for unit in sorted(edges) if unit not in rank]
    for unit in sorted(edges):
        for dep in sorted(edges[unit]):
            if unit in rank and dep in rank and rank[dep] > rank[unit]:
                problems.append(f"{unit} imports {dep}, a layer above it (layers import downward only)")
    return problems


def host_users(src: Path, order: list[list[str]] | None) -> list[str]:
    """Code outside `HOST_LAYERS` naming the `Host` trait, and the worker naming
    `RequestFilter`. Checked only where layers are drawn, and only for the layers drawn."""
    drawn = {unit for units in order or [] for unit in units}
    problems = []
    for file, module in layer_files(src):
        text = code(file.read_text())
        where = file.relative_to(src)
        if module[0] in drawn and module[0] not in HOST_LAYERS and HOST.search(text):
            problems.append(f"{where}: names the Host, which only {', '.join(sorted(HOST_LAYERS))} take")
        if module[0] == "worker" and REQUEST_FILTER.search(text):
            problems.append(f"{where}: the worker names RequestFilter (a request's life is the lifecycle's)")
    return problems


def route_modules(src: Path) -> dict[str, tuple[Path, set[str]]]:
    """Each module of the route folder (but its mod.rs): its file, and the functions it
    defines (free ones, and methods of its inherent impls; a trait's methods are the
    trait's, and are not counted)."""
    found = {}
    for file, module in layer_files(src):
        if module[0] != ROUTE_FOLDER or len(module) != 2:
            continue
        names, inherent = set(), False
        for line in code(file.read_text()).splitlines():
            if line.startswith("impl"):
                inherent = " for " not in line
            if m := FREE_FN.match(line):
                names.add(m.group(1))
            elif (m := METHOD.match(line)) and inherent:
                names.add(m.group(1))
        found[module[1]] = (file, names)
    return found


def route_calls(src: Path) -> list[str]:
    """A route, or a module every route shares, naming another route's module or calling
    a function another route defines."""
    modules = route_modules(src)
    routes = {name: names for name, (_, names) in modules.items() if name not in ROUTE_SHARED}
    problems = []
    for name, (file, own) in sorted(modules.items()):
        text = code(file.read_text())
        named = {path[1] for path in paths(text, [ROUTE_FOLDER, name]) if path[0] == ROUTE_FOLDER and len(path) > 1}
        # The body without its definitions' names: `fn send(` is not a call of `send`.
        calls = re.sub(r"\bfn\s+\w+", "fn _", text)
        for route, names in sorted(routes.items()):
            if route == name:
                continue
            if route in named:
                problems.append(f"{ROUTE_FOLDER}/{name}: names the {route} route's module")
            for fn in sorted(names - own):
                if re.search(rf"(?:(?<![\w:])|(?<=Self::)){fn}\s*(?:::<[^(]*>)?\(", calls):
                    problems.append(
                        f"{ROUTE_FOLDER}/{name}: calls {fn}, of the {route} route (a route returns its"
                        f" outcome to the dispatcher in {ROUTE_FOLDER}/mod.rs, never calls another)"
                    )
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one unit, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def check(src: Path, known: set[str]) -> list[str]:
    """What is wrong: imports upward, cycles not in `known`, and entries of `known` that are gone."""
    edges = graph(src)
    order = layers(src)
    present = {" ".join(c) for c in cycles(edges)}
    problems = upward(edges, order) + host_users(src, order) if order is not None else []
    problems += route_calls(src)
    for unit in sorted(edges):
        problems += [f"import cycle in {unit}/: {' '.join(c)}" for c in cycles(folder_graph(src, unit))]
    problems += [f"import cycle: {c} (layers must import downward only)" for c in sorted(present - known)]
    problems += [f"{c}: listed in layer_cycles.txt but gone; remove it" for c in sorted(known - present)]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=ROOT / "crates/core/src")
    parser.add_argument("--known", type=Path, default=ROOT / "scripts/layer_cycles.txt")
    args = parser.parse_args()
    known = set()
    if args.known.exists():
        known = {line.strip() for line in args.known.read_text().splitlines() if line.strip() and not line.startswith("#")}
    if layers(args.src) is None:
        print(f"check_layers: {args.src / 'lib.rs'} draws no layers (a ```text block in its crate doc)", file=sys.stderr)
        return 1
    problems = check(args.src, known)
    for problem in problems:
        print(f"check_layers: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
