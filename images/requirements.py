"""Write each extra's third-party requirements, read from pyproject.toml, one file per extra.

    python3 images/requirements.py pyproject.toml OUT_DIR

``OUT_DIR/<extra>.txt`` holds the project's own dependencies and the extra's (an extra
that names ``dpserve[other]`` gets ``other``'s too), never dpserve itself. The
Dockerfile installs these in layers that depend only on this list, and the dpserve
wheel afterwards with ``--no-deps``: a code change then rebuilds a small layer, not
the one with torch. Standard library only (it runs in the bare base image).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import tomllib

# "dpserve[a,b]" (any spelling PEP 503 normalises to the project's name), markers aside.
SELF = re.compile(r"^\s*(?P<name>[A-Za-z0-9._-]+)\s*\[(?P<extras>[^\]]*)\]\s*(?:;.*)?$")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(project: dict[str, Any], extra: str) -> list[str]:
    """The requirements ``pip install 'dpserve[extra]'`` would add, in pyproject's order."""
    name = normalise(str(project["name"]))
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = [extra], set[str]()
    while todo:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.add(current)
        for req in extras[current]:
            match = SELF.match(req)
            if match and normalise(match.group("name")) == name:
                todo.extend(e.strip() for e in match.group("extras").split(",") if e.strip())
            elif req not in out:
                out.append(req)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    project = tomllib.loads(Path(argv[0]).read_text())["project"]
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for extra in project.get("optional-dependencies", {}):
        (out_dir / f"{extra}.txt").write_text("\n".join(requirements(project, extra)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
