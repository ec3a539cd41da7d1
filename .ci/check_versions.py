"""Exit 1 unless every workspace package's version equals the release tag (argv[1])."""

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
tag = sys.argv[1]
bad = []
for path in sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]):
    project = tomllib.loads(path.read_text())["project"]
    if project["version"] != tag:
        bad.append(f"{project['name']} {project['version']}")
if bad:
    sys.exit(f"tag v{tag} does not match: {', '.join(bad)}")
print(f"all packages at {tag}")
