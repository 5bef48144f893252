"""Triton kernels, one file per op: private kernels (decorated with ``_common.jit``) plus a public launcher that
checks shapes, allocates and launches. Without a CUDA GPU they run in Triton's interpreter, switched on for
moelab's kernels only (``kernels/interpret.py``); the process's other Triton kernels stay compiled."""
