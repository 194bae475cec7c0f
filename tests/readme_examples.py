"""The README's Python examples, run as written against a test's server."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_readme_example(port: int, holding: str) -> dict[str, Any]:
    """Run the README's one Python example that holds ``holding`` against ``port``; its names."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    (code,) = [b for b in blocks if holding in b]
    scope: dict[str, Any] = {}
    exec(code.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), scope)
    return scope
