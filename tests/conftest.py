import os
import sys

# Test helpers (tests/helpers.py) are plain modules next to the tests; with --import-mode=importlib the
# tests directory is not on sys.path by itself.
sys.path.insert(0, os.path.dirname(__file__))
