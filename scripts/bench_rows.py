"""Print the rows of a ``python -m moelab.bench --out`` JSON a line each, medians to 0.1 µs (the markdown tables
round to whole µs): ``python scripts/bench_rows.py run.json [more.json ...]``."""

import json
import sys

for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        if r.get("median_us") is not None:
            print(f"{r['shape']:16s} T={r['T']:<6} {r['impl']} {r.get('variant', '')}: {r['median_us']:.1f} µs"
                  f" ({r.get('check', '')})")
