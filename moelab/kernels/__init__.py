"""Triton kernels, one file per op: private ``@triton.jit`` kernels plus a public launcher that checks
shapes, allocates and launches. Under ``TRITON_INTERPRET=1`` (no GPU) they run in Triton's interpreter."""
