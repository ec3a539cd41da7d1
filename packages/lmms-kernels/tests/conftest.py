import pathlib
import sys

# make the shared helpers (_kernels_ref.py) importable from the test modules
sys.path.insert(0, str(pathlib.Path(__file__).parent))
