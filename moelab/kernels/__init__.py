"""Triton kernels, one file per op: private ``@triton.jit`` kernels plus a public launcher that checks
shapes, allocates and launches. Without a CUDA GPU they run in Triton's interpreter
(``moelab.kernels._common.jit``)."""
