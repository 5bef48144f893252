"""``python -m moelab.bench``: see ``moelab.bench``."""

from moelab.bench.cli import console_main

console_main()
