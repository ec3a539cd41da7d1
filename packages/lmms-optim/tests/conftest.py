"""Puts this folder on sys.path so tests share the from-scratch references (optim_reference)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
