#!/usr/bin/env python3
"""Fails on an import cycle between the core's top-level modules and folders.

Reads every non-test `.rs` file under a crate's `src/`, collects the `crate::…` and
`super::…` paths it names (in `use` lines and inline), maps each to the top-level unit it
lands in (a folder such as `providers/`, or a flat module such as `charge.rs`), and looks
for strongly connected components in that graph: each one of more than one unit is a
cycle, which layers going downward only cannot have.

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


def module_of(src: Path, file: Path) -> list[str]:
    """The module path of `file` (`providers/gemini.rs` -> ["providers", "gemini"])."""
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return parts


def references(text: str, module: list[str]) -> set[str]:
    """The top-level units `text` (the file of `module`) names through `crate::`/`super::`."""
    cut = TEST_MODULE.search(text)
    if cut:
        text = text[: cut.start()]
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("//"))
    found = set()
    for group in USE_GROUP.finditer(text):
        for item in re.split(r"[,\s]+", group.group(1)):
            name = item.split("::")[0].strip("{} ")
            if name and name != "self":
                found.add(name)
    for match in PATH.finditer(text):
        segments = [s for s in match.group(2).split("::") if s and s != "{"]
        if match.group(1) == "super":
            base = module[:-1]
            while segments and segments[0] == "super":
                segments.pop(0)
                base = base[:-1]
            segments = base + segments
        if segments:
            found.add(segments[0])
    return found


def graph(src: Path) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for file in sorted(src.rglob("*.rs")):
        if TEST_FILES.search(file.name) or file.name == "build.rs":
            continue
        module = module_of(src, file)
        if not module:  # lib.rs: declares the units, imports none of them
            continue
        unit = module[0]
        units.setdefault(unit, set()).update(references(file.read_text(), module) - {unit})
    return {unit: {d for d in deps if d in units} for unit, deps in units.items()}


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
    """What is wrong: cycles not in `known`, and entries of `known` that are gone."""
    present = {" ".join(c) for c in cycles(graph(src))}
    problems = [f"import cycle: {c} (layers must import downward only)" for c in sorted(present - known)]
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
    problems = check(args.src, known)
    for problem in problems:
        print(f"check_layers: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
