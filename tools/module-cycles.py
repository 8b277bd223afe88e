#!/usr/bin/env python3
"""Lists import cycles between sibling modules of each folder of a crate.

A module is a `.rs` file (or a folder's `mod.rs`); an edge a -> b means a file of
module a (or of its children) names `crate::<path to b>`, `super::b` or `self::b`.
Two siblings that reach each other form a cycle. Usage:

    python3 tools/module-cycles.py            # every crate of the workspace
    python3 tools/module-cycles.py src        # one crate's src folder

Exits 1 when a cycle is found.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = {"src": "caracal", "actors/src": "caracal_actors", "kernels/src": "caracal_kernels", "media/src": "caracal_media"}


def module_path(src: Path, f: Path):
    rel = f.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def refs(text: str, here: list):
    """Module paths (as lists) that `text` names, resolved against `here`."""
    out = []
    text = re.sub(r"//[^\n]*", "", text)
    # expand `use a::{b, c::d}` one level: enough to see sibling names
    for m in re.finditer(r"\b(crate|super|self)((?:::\w+)+)(?:::\{([^}]*)\})?", text):
        head, tail, group = m.group(1), m.group(2), m.group(3)
        path = [p for p in tail.split("::") if p]
        if head == "crate":
            base = []
        elif head == "self":
            base = list(here)
        else:
            base = list(here[:-1])
            # super::super::...
            while path and path[0] == "super":
                path.pop(0)
                base = base[:-1]
        out.append(base + path)
        if group:
            for g in group.split(","):
                g = g.strip().split("::")[0].split(" as ")[0].strip()
                if g and g != "self" and re.match(r"^\w+$", g):
                    out.append(base + path + [g])
    return out


def main():
    dirs = sys.argv[1:] or list(CRATES)
    found = 0
    for d in dirs:
        src = ROOT / d
        if not src.exists():
            continue
        files = sorted(src.rglob("*.rs"))
        mods = {tuple(module_path(src, f)): f for f in files}
        # Test-only modules (`#[cfg(test)] mod x;`) and test code at the end of a
        # file (its `#[cfg(test)] mod tests { ... }`) are not part of the module graph.
        test_only = set()
        for key, f in mods.items():
            for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", f.read_text()):
                test_only.add(key + (m.group(1),))
        mods = {k: f for k, f in mods.items() if not any(k[: i + 1] in test_only for i in range(len(k)))}
        edges = {}
        for key, f in mods.items():
            here = list(key)
            # a file's own path for `self::`/`super::` is its module; a mod.rs is the folder
            text = re.split(r"#\[cfg\(test\)\]\s*mod \w+ \{", f.read_text())[0]
            for r in refs(text, here):
                # find the longest known module prefix of r
                for n in range(len(r), 0, -1):
                    if tuple(r[:n]) in mods:
                        tgt = tuple(r[:n])
                        break
                else:
                    continue
                # lift both to siblings under their common parent folder
                common = 0
                while common < min(len(key), len(tgt)) and key[common] == tgt[common]:
                    common += 1
                if common >= len(key) or common >= len(tgt):
                    continue  # parent/child: not a sibling edge
                a, b = key[: common + 1], tgt[: common + 1]
                edges.setdefault(a, set()).add(b)
        seen = set()
        for a, bs in edges.items():
            for b in bs:
                if a in edges.get(b, set()) and (b, a) not in seen:
                    seen.add((a, b))
                    found += 1
                    print(f"{d}: {'::'.join(a)} <-> {'::'.join(b)}")
    if not found:
        print("no import cycles between sibling modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
