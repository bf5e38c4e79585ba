"""Root of the tests. Being a conftest.py, this puts ``tests/`` on ``sys.path`` (pytest's
default "prepend" import mode), so every test imports the shared helpers by name:
``from waiting import wait_until``."""
