"""Merges kiln_bench's and torch_workloads.py's JSON into one table.

    /usr/bin/python3 bench/report.py KILN.json TORCH.json [--out MERGED.json]

A missing or empty input leaves its columns empty (shown as "-"), so the kiln
numbers still print where PyTorch is not installed.
"""

import argparse
import json
import os
import sys


def load(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read().strip()
    return json.loads(text) if text else []


def ms(v):
    return f"{v:.3f}" if isinstance(v, (int, float)) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kiln")
    ap.add_argument("torch")
    ap.add_argument("--out", help="write the merged list here")
    args = ap.parse_args()

    kiln = {(r["name"], r["threads"]): r for r in load(args.kiln)}
    torch = {(r["name"], r["threads"]): r for r in load(args.torch)}
    keys = list(kiln) + [k for k in torch if k not in kiln]
    keys.sort(key=lambda k: (k[0], k[1]))

    rows = []
    for name, threads in keys:
        k, t = kiln.get((name, threads), {}), torch.get((name, threads), {})
        k_ms, t_ms = k.get("kiln_eager_ms"), t.get("torch_eager_ms")
        ratio = k_ms / t_ms if k_ms is not None and t_ms else None
        rows.append({"name": name, "threads": threads,
                     "kiln_eager_ms": k_ms, "torch_eager_ms": t_ms, "ratio": ratio,
                     "kiln_eager_min_ms": k.get("kiln_eager_min_ms"),
                     "torch_builtin_ms": t.get("torch_builtin_ms"),
                     "eager_peak_bytes": k.get("eager_peak_bytes")})

    print(f"{'workload':<14} {'threads':>7} {'kiln eager ms':>14} {'torch eager ms':>15} "
          f"{'kiln/torch':>10} {'torch builtin ms':>17}")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['name']:<14} {r['threads']:>7} {ms(r['kiln_eager_ms']):>14} "
              f"{ms(r['torch_eager_ms']):>15} {ratio:>10} {ms(r['torch_builtin_ms']):>17}")
    if not rows:
        print("no results", file=sys.stderr)

    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
