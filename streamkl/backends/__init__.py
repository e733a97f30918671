"""The optimized backends, one package each (triton, cuda), with one module per op they
implement; streamkl/_backend.py states what such a module provides, streamkl._dispatch.BACKENDS
lists them, tests/test_backends.py holds each to the contract (docs/contract.md)."""
