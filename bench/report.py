"""Merges one benchmark run (kiln eager, kiln compiled, PyTorch) into tables and plots.

    /usr/bin/python3 bench/report.py --dir build/bench [--perf-md docs/perf.md] [--img-dir docs/img]

Reads from --dir what bench/run.sh wrote there: machine.json (bench/machine.py),
kiln_eager.json (kiln_bench --json, at 1 and N threads), compiled.json
(kiln_bench --compiled --json, at N threads), torch.json
(bench/torch_workloads.py) and overhead.txt (kiln_bench --overhead). A missing
or empty input leaves its columns empty ("-").

Writes --dir/report.json (everything merged) and --dir/tables.md (the tables),
prints the tables, draws the plots (bench/plots.py) into --img-dir (default
--dir/img), and with --perf-md replaces the part of that file between
<!-- bench:tables:begin --> and <!-- bench:tables:end --> with the tables
(appending the section when the markers are missing).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402  (constants and flop counts only; no PyTorch needed)

BEGIN = "<!-- bench:tables:begin -->"
END = "<!-- bench:tables:end -->"
MIB = 1024 * 1024

# What each workload's time is bound by, and its work: bytes that must move
# (memory-bound) or flops of its matmuls (compute-bound), per call. W9 is per
# generated token, as both sides report it.
WORK = {
    "W1_gelu": ("gelu", "memory", 2 * 16 * MIB),
    "W2_softmax": ("softmax", "memory", 2 * 16 * MIB),
    "W3_layernorm": ("layer norm", "memory", 2 * 16 * MIB),
    "W4_mlp_fwd": ("MLP forward", "compute", 2 * 256 * 1024 * 4096 * 2),
    "W5_mlp_train": ("MLP train step", "compute", 3 * 2 * 256 * 1024 * 4096 * 2),
    "W6_batch1": ("batch-1 MLP", "latency", 3 * 2 * 256 * 256),
    "W7_attention": ("attention", "compute", 2 * (8 * 512 * 512 * 64) * 2),
    "W8_gpt_train": ("GPT train step", "compute", torch_gpt.train_flops()),
    "W9_gpt_generate": ("GPT generate (per token)", "compute", torch_gpt.gen_flops_per_token()),
}


def load(path, default):
    if not path or not os.path.exists(path):
        return default
    with open(path) as f:
        text = f.read().strip()
    return json.loads(text) if text else default


def num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def ms(v):
    """Three significant digits, at least one decimal."""
    if not num(v):
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def ratio(a, b):
    return a / b if num(a) and num(b) else None


def x(v):
    return f"{v:.2f}x" if num(v) else "-"


def mib(v):
    if not isinstance(v, (int, float)) or v < 0:
        return "-"
    return f"{v / MIB:.1f}" if v >= 0.1 * MIB else f"{v / MIB:.3f}"


def human(n, unit):
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def order(name):
    head = name.split("_")[0]
    return (int(head[1:]) if head[1:].isdigit() else 99, name)


# ---- merge ----------------------------------------------------------------

def merge(d):
    machine = load(os.path.join(d, "machine.json"), {})
    eager = load(os.path.join(d, "kiln_eager.json"), [])
    compiled = load(os.path.join(d, "compiled.json"), [])
    tdoc = load(os.path.join(d, "torch.json"), {})
    if isinstance(tdoc, list):  # an older torch_workloads.py wrote a bare list
        tdoc = {"meta": {}, "rows": tdoc}
    torch_rows, torch_meta = tdoc.get("rows", []), tdoc.get("meta", {})
    overhead = ""
    if os.path.exists(os.path.join(d, "overhead.txt")):
        with open(os.path.join(d, "overhead.txt")) as f:
            overhead = f.read().rstrip()

    threads = compiled[0]["threads"] if compiled else max((r["threads"] for r in eager), default=None)
    limits = {}
    for r in compiled:
        if num(r.get("bandwidth_gbps")):
            limits = {"bandwidth_gbps": r["bandwidth_gbps"], "sgemm_gflops": r.get("sgemm_gflops")}
            break

    kiln_e = {(r["name"], r["threads"]): r for r in eager}
    torch_t = {(r["name"], r["threads"]): r for r in torch_rows}
    comp = {r["name"]: r for r in compiled}
    names = sorted({k[0] for k in kiln_e} | {k[0] for k in torch_t} | set(comp), key=order)
    eager_threads = sorted({k[1] for k in kiln_e} | {k[1] for k in torch_t})

    side = []  # one row per workload at the compared thread count
    for name in names:
        c = comp.get(name, {})
        t = torch_t.get((name, threads), {})
        ok = c.get("ok", False)
        row = {"name": name, "threads": threads, "compiled_ok": ok if c else None,
               "kiln_eager_ms": c.get("eager_ms") if ok else None,
               "kiln_compiled_ms": c.get("compiled_ms") if ok else None,
               "kiln_compile_ms": c.get("compile_ms") if ok else None,
               "eager_peak_bytes": c.get("eager_peak_bytes") if ok else None,
               "compiled_peak_bytes": c.get("compiled_peak_bytes") if ok else None,
               "floor_ms": c.get("floor_ms")}
        if not num(row["kiln_eager_ms"]):  # no compiled run: the eager-only run's number
            row["kiln_eager_ms"] = kiln_e.get((name, threads), {}).get("kiln_eager_ms")
        for k in ("torch_eager_ms", "torch_builtin_ms", "torchscript_ms", "torch_compiled_ms",
                  "torchscript_prep_ms", "torch_compiled_prep_ms"):
            row[k] = t.get(k)
        for k, v in c.items():  # whatever else the compiled run reports (tokens_per_s, ...)
            if k not in row and k not in ("ok", "eager_ms", "compiled_ms", "compile_ms"):
                row[k] = v
        e = row["kiln_eager_ms"]
        row["speedup"] = ratio(e, row["kiln_compiled_ms"])
        for k in ("torch_eager_ms", "torch_builtin_ms", "torchscript_ms", "torch_compiled_ms"):
            row["rel_" + k] = ratio(e, row[k])  # kiln eager / it: its speedup over kiln eager
        label, kind, work = WORK.get(name, (name, "latency", 0))
        row.update({"label": label, "bound": kind, "work": work})
        if kind in ("memory", "compute") and work:
            for k in ("kiln_eager_ms", "kiln_compiled_ms", "torch_eager_ms", "torch_builtin_ms",
                      "torchscript_ms", "torch_compiled_ms"):
                if num(row[k]):
                    row["rate_" + k] = work / (row[k] * 1e6)  # GB/s or GFLOP/s
            limit = limits.get("bandwidth_gbps" if kind == "memory" else "sgemm_gflops")
            row["limit"] = limit
            if num(limit) and num(row.get("rate_kiln_compiled_ms")):
                row["compiled_frac_of_limit"] = row["rate_kiln_compiled_ms"] / limit
        side.append(row)

    by_threads = []
    for name in names:
        for n in eager_threads:
            k, t = kiln_e.get((name, n)), torch_t.get((name, n))
            if not k:  # W8, W9: kiln eager runs beside compiled only
                continue
            t = t or {}
            by_threads.append({"name": name, "threads": n,
                               "kiln_eager_ms": k.get("kiln_eager_ms"),
                               "kiln_eager_min_ms": k.get("kiln_eager_min_ms"),
                               "torch_eager_ms": t.get("torch_eager_ms"),
                               "torch_builtin_ms": t.get("torch_builtin_ms"),
                               "torchscript_ms": t.get("torchscript_ms"),
                               "ratio": ratio(k.get("kiln_eager_ms"), t.get("torch_eager_ms")),
                               "eager_peak_bytes": k.get("eager_peak_bytes")})

    machine.setdefault("system", {})
    try:
        with open("/proc/loadavg") as f:
            machine["system"]["loadavg_end"] = f.read().split()[:3]
    except OSError:
        pass
    return {"machine": machine, "limits": limits, "threads": threads, "torch": torch_meta,
            "side_by_side": side, "eager_by_threads": by_threads, "overhead": overhead}


# ---- tables ---------------------------------------------------------------

def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def machine_lines(rep):
    m = rep["machine"]
    c, s, b, o = m.get("cpu", {}), m.get("system", {}), m.get("build", {}), m.get("openblas", {})
    t = rep["torch"]
    lines = []
    cores = c.get("usable_cpus") or c.get("logical_cpus")
    cpu = f"{c.get('cpu_model', 'unknown CPU')} (family {c.get('family', '?')}, model {c.get('model', '?')})"
    extra = [f"{cores} cores usable"]
    if c.get("threads_per_core"):
        extra.append(f"{c['threads_per_core']} hardware thread(s) per core")
    if c.get("hypervisor"):
        extra.append(f"{c['hypervisor']} guest")
    if c.get("isa"):
        extra.append(", ".join(c["isa"]))
    lines.append(f"- CPU: {cpu}; " + "; ".join(extra))
    mem = f"{c['mem_gib']} GiB" if c.get("mem_gib") else "?"
    lines.append(f"- Memory {mem}; caches: L2 {c.get('l2', '?')}, L3 {c.get('l3', '?')}")
    lines.append(f"- {s.get('os', 'unknown OS')}, kernel {s.get('kernel', '?')}; "
                 f"taken {s.get('date_utc', '?')} at commit {b.get('commit', '?')}")
    load = s.get("loadavg_start"), s.get("loadavg_end")
    if load[0] or load[1]:
        lines.append(f"- Load average (1, 5, 15 min) at the start {' '.join(load[0] or ['?'])}, "
                     f"at the end {' '.join(load[1] or ['?'])}: above 0 means other work shared the cores")
    lines.append(f"- kiln: {b.get('cc', '?')}, {b.get('build_type', '?')} build; LLVM {b.get('llvm', '?')}")
    ct = o.get("OPENBLAS_CORETYPE")
    lines.append(f"- OpenBLAS: {o.get('config', '?')}; kernels for {o.get('core', '?')}; "
                 f"OPENBLAS_CORETYPE {'= ' + ct if ct else 'not set'}"
                 + (f"; PyTorch's libblas.so.3 is {o['libblas.so.3']}" if o.get("libblas.so.3") else ""))
    if t.get("torch_version"):
        fuser = "on" if t.get("torchscript_cpu_fuser") else "off (this build has no LLVM)" \
            if not t.get("torch_llvm") else "off"
        omp = t.get("omp_wait_policy")
        lines.append(f"- PyTorch {t['torch_version']} (TorchScript CPU fuser {fuser}); "
                     f"torch.compile: {t.get('torch_compile', '?')}; run with "
                     + (f"OMP_WAIT_POLICY={omp}" if omp else "OpenMP's default wait policy"))
    else:
        lines.append("- PyTorch: not installed, its columns are empty")
    libs = rep["machine"].get("python_libs", {})
    lines.append(f"- Python {s.get('python', '?')}, numpy {libs.get('numpy') or '-'}, "
                 f"matplotlib {libs.get('matplotlib') or '-'}")
    env = rep["machine"].get("env", {})
    if env:
        lines.append("- Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    lim = rep["limits"]
    if lim:
        lines.append(f"- Measured in this run: {lim['bandwidth_gbps']:.1f} GB/s one-in/one-out bandwidth "
                     f"(a scale over 16 MiB on kiln's pool, best of 20), "
                     f"{lim['sgemm_gflops']:.0f} GFLOP/s sgemm (W4's two GEMMs in OpenBLAS, best of 5), "
                     f"{rep['threads']} threads")
    return lines


def render(rep, img_rel):
    side, T = rep["side_by_side"], rep["threads"]
    has_compile = any(num(r.get("torch_compiled_ms")) for r in side)
    out = ["## Results", "",
           "Generated by `make bench` (bench/report.py); do not edit by hand between the markers.", "",
           "### Machine", ""]
    out += machine_lines(rep)

    out += ["", f"### Side by side, {T} threads", "",
            "Median ms per call (W9: per generated token). Speedups are over kiln eager in the "
            "same run; the last columns are PyTorch's time over kiln compiled's (above 1: "
            "kiln compiled is faster).", ""]
    head = ["workload", "kiln eager", "kiln compiled", "PyTorch eager", "PyTorch fused ops", "TorchScript"]
    if has_compile:
        head.append("torch.compile")
    head += ["compiled speedup", "PyTorch eager / kiln compiled", "TorchScript / kiln compiled"]
    rows = []
    for r in side:
        comp = ms(r["kiln_compiled_ms"]) if r["compiled_ok"] is not False else "FAILED"
        cells = [f"{r['name']}", ms(r["kiln_eager_ms"]), comp, ms(r["torch_eager_ms"]),
                 ms(r["torch_builtin_ms"]), ms(r["torchscript_ms"])]
        if has_compile:
            cells.append(ms(r["torch_compiled_ms"]))
        cells += [x(r["speedup"]), x(ratio(r["torch_eager_ms"], r["kiln_compiled_ms"])),
                  x(ratio(r["torchscript_ms"], r["kiln_compiled_ms"]))]
        rows.append(cells)
    out.append(table(head, rows))
    notes = []
    if not has_compile:
        notes.append(f"torch.compile: {rep['torch'].get('torch_compile', 'not measured')}.")
    notes.append("\"PyTorch fused ops\" is PyTorch's own op for the computation (F.gelu, torch.softmax, "
                 "F.layer_norm, addmm): the bar a compiler's kernel has to reach. W8 and W9 are written "
                 "with those ops on both sides, so they have no separate fused column.")
    tok = [r for r in side if r["name"].startswith("W9")]
    for r in tok:
        vals = [("kiln eager", r["kiln_eager_ms"]), ("kiln compiled", r["kiln_compiled_ms"]),
                ("PyTorch eager", r["torch_eager_ms"]), ("TorchScript", r["torchscript_ms"])]
        if has_compile:
            vals.append(("torch.compile", r["torch_compiled_ms"]))
        notes.append(f"{r['name']} in tokens/s: " + ", ".join(
            f"{k} {1e3 / v:.0f}" for k, v in vals if num(v)) +
            f" (a {torch_gpt.PROMPT_LEN}-byte prompt, then {torch_gpt.GEN_TOKENS} bytes, "
            f"each a forward pass over the last {torch_gpt.BLOCK_SIZE} bytes at most).")
    errors = rep["torch"].get("errors") or {}
    for mode, errs in errors.items():
        for name, msg in errs.items():
            notes.append(f"PyTorch {mode} could not run {name}: {msg}")
    out += [""] + [f"- {n}" for n in notes]

    by = rep["eager_by_threads"]
    if by:
        out += ["", "### kiln eager against PyTorch eager, by thread count", "",
                "Each op by op, as docs/workloads.md writes it; kiln and PyTorch run one after the other, "
                "not interleaved.", ""]
        rows = [[r["name"], r["threads"], ms(r["kiln_eager_ms"]), ms(r["torch_eager_ms"]),
                 x(r["ratio"]).rstrip("x") if num(r["ratio"]) else "-", ms(r["torch_builtin_ms"]),
                 ms(r["torchscript_ms"]), mib(r["eager_peak_bytes"])] for r in by]
        out.append(table(["workload", "threads", "kiln eager ms", "PyTorch eager ms", "kiln / PyTorch",
                          "PyTorch fused ms", "TorchScript ms", "kiln peak MiB"], rows))

    out += ["", "### Compile time and memory", "",
            "kiln compile ms: IR passes, fusion, LLVM and linking, once per variant (the traced call, "
            "which runs the body eagerly once and returns its results, is not counted): the median of "
            "five compiles from nothing (the kernel cache cleared before each, kiln_cache_clear), the "
            "first one among them; compiled.json keeps the first, least and most. Cached: the "
            "same, for a second compiled function of the same body in the same process, whose kernels "
            "all come from the kernel cache (a later process gets the same with KILN_CACHE_DIR). "
            "TorchScript prep ms: script and freeze, plus what its first two (profiling) calls took "
            "beyond the steady state. Peak: tensor storage a call adds (kiln_mem_peak); the compiled "
            "side counts the arena it keeps between calls.", ""]
    head = ["workload", "kiln compile ms", "range of five", "cached ms", "TorchScript prep ms"]
    if has_compile:
        head.append("torch.compile prep ms")
    head += ["eager peak MiB", "compiled peak MiB", "compiled / eager"]
    rows = []
    for r in side:
        lo, hi = r.get("compile_min_ms"), r.get("compile_max_ms")
        span = f"{ms(lo)}-{ms(hi)}" if num(lo) and num(hi) else "-"
        cells = [r["name"], ms(r["kiln_compile_ms"]), span, ms(r.get("compile_cached_ms")), ms(r["torchscript_prep_ms"])]
        if has_compile:
            cells.append(ms(r["torch_compiled_prep_ms"]))
        pe, pc = r["eager_peak_bytes"], r["compiled_peak_bytes"]
        cells += [mib(pe), mib(pc), f"{pc / pe:.2f}" if num(pe) and isinstance(pc, int) else "-"]
        rows.append(cells)
    out.append(table(head, rows))

    lim = rep["limits"]
    if lim and any(r["bound"] in ("memory", "compute") for r in side):
        out += ["", "### Against the machine's limits", "",
                f"Achieved rate = the workload's work over its median time: GB/s of the bytes a fused "
                f"pass must move (memory-bound), GFLOP/s of its matmuls (compute-bound). Limits measured "
                f"in the same run: {lim['bandwidth_gbps']:.1f} GB/s and {lim['sgemm_gflops']:.0f} GFLOP/s "
                f"(a share above 100% means the limit was measured at a busier moment than the "
                f"workload ran). W6 is bound by neither: by reading its 768 KiB of weights from the "
                f"core's L2, and by per-call overhead.", ""]
        rows = []
        for r in side:
            if r["bound"] not in ("memory", "compute"):
                continue
            unit = "GB/s" if r["bound"] == "memory" else "GFLOP/s"
            work = human(r["work"], "B" if r["bound"] == "memory" else "FLOP")

            def rate(k):
                v = r.get("rate_" + k)
                return f"{v:.1f}" if num(v) else "-"
            frac = r.get("compiled_frac_of_limit")
            rows.append([r["name"], f"{r['bound']} ({unit})", work, ms(r["floor_ms"]),
                         rate("kiln_eager_ms"), rate("kiln_compiled_ms"), rate("torch_eager_ms"),
                         rate("torch_builtin_ms"), rate("torchscript_ms"),
                         f"{100 * frac:.0f}%" if num(frac) else "-"])
        out.append(table(["workload", "bound by", "work per call", "kiln floor ms", "kiln eager",
                          "kiln compiled", "PyTorch eager", "PyTorch fused", "TorchScript",
                          "compiled, share of limit"], rows))

    if rep["overhead"]:
        out += ["", "### Call overhead", "", "`kiln_bench --overhead`:", "", "```",
                rep["overhead"], "```"]

    if img_rel is not None:
        out += ["", "### Plots", ""]
        for fname, alt in (("speedup.svg", "Speedup over kiln eager per workload"),
                           ("limits.svg", "Achieved bandwidth and GFLOP/s against the measured limits"),
                           ("compile.svg", "Compile time per workload")):
            out.append(f"![{alt}]({img_rel}/{fname})")
            out.append("")
        out.pop()
    return "\n".join(out) + "\n"


def splice(path, section):
    """Replaces the marked section of path (appends it when unmarked)."""
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="where run.sh wrote the run's JSON")
    ap.add_argument("--perf-md", help="rewrite the generated section of this markdown file")
    ap.add_argument("--img-dir", help="write the plots here (default: DIR/img)")
    args = ap.parse_args()

    rep = merge(args.dir)
    if not rep["side_by_side"]:
        print("report: no results in " + args.dir, file=sys.stderr)
        return 1
    img_dir = args.img_dir or os.path.join(args.dir, "img")
    drawn = False
    try:
        import plots
        plots.draw_all(rep, img_dir)
        drawn = True
    except ImportError as e:
        print(f"report: no plots ({e}); install python3-matplotlib", file=sys.stderr)

    base = os.path.dirname(os.path.abspath(args.perf_md)) if args.perf_md else os.path.abspath(args.dir)
    img_rel = os.path.relpath(os.path.abspath(img_dir), base) if drawn else None
    section = render(rep, img_rel)
    with open(os.path.join(args.dir, "report.json"), "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.dir, "tables.md"), "w") as f:
        f.write(section)
    print(section)
    if args.perf_md:
        splice(args.perf_md, section)
        print(f"report: rewrote the generated section of {args.perf_md}"
              + (f", plots in {img_dir}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
