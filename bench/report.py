"""Merges one benchmark run into tables and plots.

    build/venv/bin/python bench/report.py --dir build/bench [--perf-md docs/perf.md] [--img-dir docs/img]

Reads from --dir what bench/run.sh wrote there: machine.json (bench/machine.py),
side_by_side.json (bench/side_by_side.py: every contender interleaved, at 1
and N threads), compiled.json (kiln_bench --compiled --json, at N threads:
kiln's compile times, memory and the machine's limits) and overhead.txt
(kiln_bench --overhead), and torch_resnet.json when there is one
(bench/torch_resnet.py run by hand: its PyTorch eager and torch.compile times
fill W13's and W14's cells that side_by_side.json left empty, marked as from a
separate run). A missing or empty input leaves its columns empty ("-"), with
the reason in the notes when one was recorded.

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
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402  (constants and flop counts only; no PyTorch needed)
import torch_llama  # noqa: E402  (the same: W11's token count)

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
    # W10: an LSTM step's two matmuls are 2*B*(I+H)*4H flops (B 32, I = H = 128); the backward twice that
    "W10_lstm_train": ("LSTM train step, T 64", "compute", 3 * 64 * 2 * 32 * 256 * 512),
    **{f"W10_lstm_fwd_T{t}": (f"LSTM forward, T {t}", "compute", t * 2 * 32 * 256 * 512) for t in (16, 32, 64, 128)},
    "W13_resnet18_b1": ("ResNet-18 inference, batch 1", "latency", 0),
    "W13_resnet18_b32": ("ResNet-18 inference, batch 32", "latency", 0),
    "W14_resnet18_train": ("ResNet-18 train step", "latency", 0),
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
    """Workloads by number, then their rows with numbers in numeric order (W10_lstm_fwd_T16 before _T128)."""
    head = name.split("_")[0]
    return (int(head[1:]) if head[1:].isdigit() else 99, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)])


# ---- the contenders ----------------------------------------------------------

# (key, column name) in the order of every table and plot
MODES = [
    ("kiln_eager", "kiln eager"),
    ("kiln_compiled", "kiln compiled"),
    ("torch_eager", "PyTorch eager"),
    ("torch_builtin", "PyTorch fused ops"),
    ("torch_compile", "torch.compile"),
    ("torch_compile_max", "torch.compile max-autotune"),
    ("jax_jit", "JAX jit"),
]
LABEL = dict(MODES)
COMPILERS = ("kiln_compiled", "torch_compile", "torch_compile_max", "jax_jit")


# ---- merge ----------------------------------------------------------------

def merge(d):
    machine = load(os.path.join(d, "machine.json"), {})
    compiled = load(os.path.join(d, "compiled.json"), [])
    sdoc = load(os.path.join(d, "side_by_side.json"), {})
    srows, smeta = sdoc.get("rows", []), sdoc.get("meta", {})
    resnet = {(r["name"], r["threads"]): r for r in load(os.path.join(d, "torch_resnet.json"), {}).get("rows", [])}
    overhead = ""
    if os.path.exists(os.path.join(d, "overhead.txt")):
        with open(os.path.join(d, "overhead.txt")) as f:
            overhead = f.read().rstrip()

    threads = max((r["threads"] for r in srows), default=None) or (compiled[0]["threads"] if compiled else None)
    limits = {}
    for r in compiled:
        if num(r.get("bandwidth_gbps")):
            limits = {"bandwidth_gbps": r["bandwidth_gbps"], "sgemm_gflops": r.get("sgemm_gflops")}
            break

    comp = {r["name"]: r for r in compiled}
    sbs = {(r["name"], r["threads"]): r for r in srows}
    names = sorted({k[0] for k in sbs} | set(comp), key=order)

    side = []  # one row per workload at the compared thread count
    for name in names:
        c = comp.get(name, {})
        s = sbs.get((name, threads), {})
        ok = c.get("ok", False)
        row = {"name": name, "threads": threads, "rounds": s.get("samples"),
               "compiled_ok": ok if c else None,
               "kiln_compile_ms": c.get("compile_ms") if ok else None,
               "eager_peak_bytes": c.get("eager_peak_bytes") if ok else None,
               "compiled_peak_bytes": c.get("compiled_peak_bytes") if ok else None,
               "floor_ms": c.get("floor_ms")}
        for k, v in c.items():  # whatever else kiln's compiled run reports (compile range, cached, ...)
            if k not in row and k not in ("ok", "eager_ms", "compiled_ms", "compile_ms", "threads", "name"):
                row[k] = v
        for m, _ in MODES:
            for suffix in ("_ms", "_min_ms", "_over_kiln_compiled", "_over_kiln_eager", "_compile_ms"):
                if num(s.get(m + suffix)):
                    row[m + suffix] = s[m + suffix]
        row["source"] = "side_by_side" if s else "kiln_bench"
        tr = resnet.get((name, threads), {})  # a separate run: no ratios against kiln's samples
        for m, key in (("torch_eager", "torch_eager_ms"), ("torch_compile", "torch_compiled_ms")):
            if not num(row.get(m + "_ms")) and num(tr.get(key)):
                row[m + "_ms"] = tr[key]
                row.setdefault("separate_run", []).append(m)
        if "torch_compile" in row.get("separate_run", []) and num(tr.get("torch_compiled_prep_ms")):
            row["torch_compile_compile_ms"] = tr["torch_compiled_prep_ms"]
        if not s and ok:  # no side-by-side run: kiln's own interleaved pair
            row["kiln_eager_ms"], row["kiln_compiled_ms"] = c.get("eager_ms"), c.get("compiled_ms")
            row["kiln_eager_over_kiln_compiled"] = ratio(c.get("eager_ms"), c.get("compiled_ms"))
        label, kind, work = WORK.get(name, (name, "latency", 0))
        row.update({"label": label, "bound": kind, "work": work})
        if kind in ("memory", "compute") and work:
            for m, _ in MODES:
                if num(row.get(m + "_ms")):
                    row["rate_" + m] = work / (row[m + "_ms"] * 1e6)  # GB/s or GFLOP/s
            limit = limits.get("bandwidth_gbps" if kind == "memory" else "sgemm_gflops")
            row["limit"] = limit
            if num(limit) and num(row.get("rate_kiln_compiled")):
                row["compiled_frac_of_limit"] = row["rate_kiln_compiled"] / limit
        side.append(row)

    by_threads = []
    for name in names:
        for n in sorted({k[1] for k in sbs if k[0] == name}):
            s = sbs[(name, n)]
            by_threads.append({"name": name, "threads": n, "rounds": s.get("samples"),
                               **{k: s.get(k) for k in ("kiln_eager_ms", "kiln_eager_min_ms", "torch_eager_ms",
                                                        "torch_builtin_ms", "torch_eager_over_kiln_eager",
                                                        "torch_builtin_over_kiln_eager")},
                               "eager_peak_bytes": comp.get(name, {}).get("eager_peak_bytes")})

    machine.setdefault("system", {})
    try:
        with open("/proc/loadavg") as f:
            machine["system"]["loadavg_end"] = f.read().split()[:3]
    except OSError:
        pass
    return {"machine": machine, "limits": limits, "threads": threads, "meta": smeta,
            "side_by_side": side, "eager_by_threads": by_threads, "overhead": overhead}


# ---- tables ---------------------------------------------------------------

def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def cpu_tag(rep):
    """The CPU and its vector width, for every table's heading."""
    c = rep["machine"].get("cpu", {})
    return f"{c.get('cpu_model', 'unknown CPU')}, {c.get('vector', '?')}"


def machine_lines(rep):
    m = rep["machine"]
    c, s, b, o = m.get("cpu", {}), m.get("system", {}), m.get("build", {}), m.get("openblas", {})
    meta = rep["meta"]
    v = meta.get("versions", {})
    lines = []
    cores = c.get("usable_cpus") or c.get("logical_cpus")
    cpu = f"{c.get('cpu_model', 'unknown CPU')} (family {c.get('family', '?')}, model {c.get('model', '?')})"
    extra = [f"vectors: {c.get('vector', '?')}", f"{cores} cores usable"]
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
    load_ = s.get("loadavg_start"), s.get("loadavg_end")
    if load_[0] or load_[1]:
        lines.append(f"- Load average (1, 5, 15 min) at the start {' '.join(load_[0] or ['?'])}, "
                     f"at the end {' '.join(load_[1] or ['?'])}: above 0 means other work shared the cores")
    lines.append(f"- kiln: {b.get('cc', '?')}, {b.get('build_type', '?')} build; LLVM {b.get('llvm', '?')}")
    ct = o.get("OPENBLAS_CORETYPE")
    lines.append(f"- OpenBLAS (kiln's matmuls): {o.get('config', '?')}; kernels for {o.get('core', '?')}; "
                 f"OPENBLAS_CORETYPE {'= ' + ct if ct else 'not set'}")
    if v.get("torch"):
        blas = v.get("torch_blas") or "?"
        lines.append(f"- PyTorch {v['torch']} (its matmuls: {blas}"
                     + (" and oneDNN" if v.get("torch_onednn") else "")
                     + f"; CPU capability {v.get('torch_cpu_capability', '?')}); run with "
                     + (f"OMP_WAIT_POLICY={meta['omp_wait_policy']}" if meta.get("omp_wait_policy")
                        else "OpenMP's default wait policy"))
    else:
        why = meta.get("unavailable", {}).get("torch_eager", "not run")
        lines.append(f"- PyTorch: its columns are empty ({why})")
    if v.get("jax"):
        lines.append(f"- JAX {v['jax']}, jaxlib {v.get('jaxlib', '?')} (XLA on the CPU; "
                     f"XLA_FLAGS={v.get('xla_flags') or 'unset'})")
    else:
        why = meta.get("unavailable", {}).get("jax_jit", "not run")
        lines.append(f"- JAX: its column is empty ({why})")
    lines.append(f"- Python {v.get('python') or s.get('python', '?')}, numpy {v.get('numpy') or '-'}, "
                 f"matplotlib {v.get('matplotlib') or '-'}"
                 + (f"; {meta['env_note']}" if meta.get("env_note") else ""))
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


def empty_notes(rep, modes):
    """Why cells are empty: the driver's recorded reasons, one line per reason."""
    meta = rep["meta"]
    notes = []
    for m in modes:
        if m in meta.get("unavailable", {}):
            notes.append(f"{LABEL[m]}: not run ({meta['unavailable'][m]}).")
    for m in modes:
        by_reason = {}
        for where, why in (meta.get("errors", {}).get(m) or {}).items():
            name, _, n = where.partition("@")
            if str(n) == str(rep["threads"]):
                by_reason.setdefault(why, []).append(name)
        for why, names in by_reason.items():
            notes.append(f"{LABEL[m]}, {', '.join(names)}: {why}.")
    return notes


def render(rep, img_rel):
    side, T = rep["side_by_side"], rep["threads"]
    tag = cpu_tag(rep)
    meta = rep["meta"]
    present = [m for m, _ in MODES if any(num(r.get(m + "_ms")) for r in side)] or ["kiln_eager", "kiln_compiled"]
    shown = [m for m, _ in MODES if m in present or m in meta.get("modes", [])]
    out = ["## Results", "",
           "Generated by `make bench` (bench/report.py); do not edit by hand between the markers.", "",
           "### Machine", ""]
    out += machine_lines(rep)

    out += ["", f"### Side by side: median ms per call, {T} threads ({tag})", "",
            "Every contender of a row was timed in the same rounds of one run (bench/side_by_side.py), "
            "each round calling each once, so load on the machine fell on all alike. W9 and W11: ms per "
            "generated token.", ""]
    rows = []
    for r in side:
        cells = [r["name"]]
        for m in shown:
            v = r.get(m + "_ms")
            cells.append("FAILED" if m == "kiln_compiled" and r["compiled_ok"] is False and not num(v) else ms(v))
        cells.append(r.get("rounds") or "-")
        rows.append(cells)
    out.append(table(["workload"] + [LABEL[m] for m in shown] + ["rounds"], rows))
    notes = empty_notes(rep, shown)
    if all(r["source"] == "kiln_bench" for r in side):
        notes.insert(0, "bench/side_by_side.py left no results (see the run's log): these are kiln's own "
                        "interleaved eager and compiled samples (kiln_bench --compiled); the other "
                        "contenders were not measured.")
    notes.append("\"PyTorch fused ops\" is PyTorch's own op for the computation (F.gelu, torch.softmax, "
                 "F.layer_norm, addmm, F.linear, F.scaled_dot_product_attention, nn.LSTM for W10; W8 and W9: the same GPT "
                 "with F.scaled_dot_product_attention (and addmm in W9_gpt_generate_kv) and, in W8, the fused AdamW; W11 and W12: the same "
                 "Llama with F.rms_norm, F.silu, F.linear and F.scaled_dot_product_attention): the bar a compiler's "
                 "kernel has to reach. The other PyTorch columns and JAX run the op-by-op program.")
    notes.append("torch.compile of the training steps (W5, W8, W10) compiles the loss (forward and, through "
                 "AOTAutograd, backward); the optimizer step runs eagerly from Python. kiln and JAX "
                 "compile the whole step, update included.")
    fwd = [r for r in side if r["name"].startswith("W10_lstm_fwd") and r.get("compiled_ok")
           and isinstance(r.get("variants"), int)]
    if len(fwd) > 1:  # one length says nothing about variants across lengths
        v = max(r["variants"] for r in fwd)
        notes.append(f"W10: kiln_bench --compiled called one compiled function at every length of the forward rows "
                     f"({', '.join(r['name'].rsplit('_T', 1)[1] for r in fwd)}); it made {v} variant"
                     f"{'' if v == 1 else 's'} (the target: 1). In the side-by-side run each row is a function of "
                     f"its own; torch.compile and jax.jit specialize on the length, one compile per row.")
    for r in side:
        if r.get("separate_run"):
            notes.append(f"{r['name']}: " + ", ".join(LABEL[m] for m in r["separate_run"]) +
                         " from bench/torch_resnet.py's torch_resnet.json, a separate run, not interleaved.")
        if r["name"].startswith("W9"):
            vals = [(LABEL[m], r.get(m + "_ms")) for m in shown]
            notes.append(f"{r['name']} in tokens/s: " + ", ".join(f"{k} {1e3 / v:.0f}" for k, v in vals if num(v)) +
                         f" (a {torch_gpt.PROMPT_LEN}-byte prompt, then {torch_gpt.GEN_TOKENS} bytes, " +
                         (f"each decoded through the KV caches of {torch_gpt.BLOCK_SIZE} rows; PyTorch eager and "
                          "fused ops attend over the rows so far, kiln (eager too) and torch.compile run one step "
                          "whose position is a tensor input, every row attended with those past it masked out)." if r["name"].endswith("_kv") else
                          f"each a forward pass over the last {torch_gpt.BLOCK_SIZE} bytes at most)."))
        if r["name"] == "W11_llama_generate":
            vals = [(LABEL[m], r.get(m + "_ms")) for m in shown]
            notes.append(f"{r['name']} in tokens/s: " + ", ".join(f"{k} {1e3 / v:.0f}" for k, v in vals if num(v)) +
                         f" ({torch_llama.GEN_TOKENS} tokens from BOS through the KV cache; the eager columns "
                         "attend over the cache rows so far, the compilers compile one step whose position is "
                         "a tensor input, attending over every row with those past it masked out: one graph "
                         "for every position).")
    out += [""] + [f"- {n}" for n in notes]

    others = [m for m in shown if m != "kiln_compiled"]
    if any(num(r.get(m + "_over_kiln_compiled")) for r in side for m in others):
        out += ["", f"### Against kiln compiled: time over kiln compiled's, {T} threads ({tag})", "",
                "The median over rounds of each contender's time over kiln compiled's in the same round: "
                "above 1, kiln compiled is faster by that factor; below 1, the contender is.", ""]
        rows = [[r["name"]] + [x(r.get(m + "_over_kiln_compiled")) for m in others] for r in side]
        out.append(table(["workload"] + [LABEL[m] for m in others], rows))

    if any(num(r.get(m + "_min_ms")) for r in side for m in shown):
        out += ["", f"### Best call: least ms per call, {T} threads ({tag})", "",
                "The fastest of each contender's samples in the same rounds: what its code does when "
                "the machine leaves it alone.", ""]
        rows = [[r["name"]] + [ms(r.get(m + "_min_ms")) for m in shown] for r in side]
        out.append(table(["workload"] + [LABEL[m] for m in shown], rows))

    by = [r for r in rep["eager_by_threads"]]
    if by:
        out += ["", f"### kiln eager against PyTorch eager, by thread count ({tag})", "",
                "Op by op, as docs/workloads.md writes it, interleaved in the same rounds; kiln / PyTorch is "
                "the median over rounds of kiln eager's time over PyTorch eager's.", ""]
        rows = []
        for r in by:
            q = r.get("torch_eager_over_kiln_eager")
            rows.append([r["name"], r["threads"], ms(r["kiln_eager_ms"]), ms(r["torch_eager_ms"]),
                         f"{1 / q:.2f}" if num(q) else "-", ms(r["torch_builtin_ms"]),
                         mib(r["eager_peak_bytes"]) if r["eager_peak_bytes"] is not None else "-"])
        out.append(table(["workload", "threads", "kiln eager ms", "PyTorch eager ms", "kiln / PyTorch",
                          "PyTorch fused ms", "kiln peak MiB"], rows))

    comp_modes = [m for m in COMPILERS[1:] if m in shown]
    out += ["", f"### Compile time and memory ({tag})", "",
            "kiln compile ms: IR passes, fusion, LLVM and linking, once per variant (the traced call, "
            "which runs the body eagerly once and returns its results, is not counted): the median of "
            "five compiles from nothing (the kernel cache cleared before each, kiln_cache_clear), the "
            "first one among them (kiln_bench --compiled); compiled.json keeps the first, least and "
            "most. Cached: the same, for a second compiled function of the same body in the same "
            "process, whose kernels all come from the kernel cache. torch.compile: what its first two "
            "calls took beyond two steady calls (Dynamo, AOTAutograd, Inductor and the C++ compiler, "
            "for forward and backward), from empty caches (Inductor's fresh_cache), one compile per "
            "mode, in a process whose first compile (the compiler's own start-up"
            + (f", {meta['torch_compile_startup_ms'] / 1e3:.1f} s" if num(meta.get("torch_compile_startup_ms")) else "")
            + ") was already paid. JAX: jax.jit(f).lower(...).compile() (W9: for each of the 53 "
            "context lengths, which jit specializes on; their sum). Peak: tensor storage a kiln call "
            "adds (kiln_mem_peak); the compiled side counts the arena it keeps between calls.", ""]
    head = ["workload", "kiln compile ms", "range of five", "cached ms"] + \
        [LABEL[m] + " ms" for m in comp_modes] + ["kiln eager peak MiB", "kiln compiled peak MiB",
                                                  "compiled / eager"]
    rows = []
    for r in side:
        lo, hi = r.get("compile_min_ms"), r.get("compile_max_ms")
        span = f"{ms(lo)}-{ms(hi)}" if num(lo) and num(hi) else "-"
        cells = [r["name"], ms(r["kiln_compile_ms"]), span, ms(r.get("compile_cached_ms"))]
        cells += [ms(r.get(m + "_compile_ms")) for m in comp_modes]
        pe, pc = r["eager_peak_bytes"], r["compiled_peak_bytes"]
        cells += [mib(pe) if pe is not None else "-", mib(pc) if pc is not None else "-",
                  f"{pc / pe:.2f}" if num(pe) and isinstance(pc, int) else "-"]
        rows.append(cells)
    out.append(table(head, rows))

    lim = rep["limits"]
    if lim and any(r["bound"] in ("memory", "compute") for r in side):
        out += ["", f"### Against the machine's limits, {T} threads ({tag})", "",
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
            frac = r.get("compiled_frac_of_limit")
            rows.append([r["name"], f"{r['bound']} ({unit})", work, ms(r["floor_ms"])]
                        + [f"{r['rate_' + m]:.1f}" if num(r.get("rate_" + m)) else "-" for m in shown]
                        + [f"{100 * frac:.0f}%" if num(frac) else "-"])
        out.append(table(["workload", "bound by", "work per call", "kiln floor ms"] + [LABEL[m] for m in shown]
                         + ["kiln compiled, share of limit"], rows))

    if rep["overhead"]:
        out += ["", f"### Call overhead ({tag})", "", "`kiln_bench --overhead`:", "", "```",
                rep["overhead"], "```"]

    if img_rel is not None:
        out += ["", "### Plots", ""]
        for fname, alt in (("vs_kiln.svg", "Each contender's time over kiln compiled's, per workload"),
                           ("speedup.svg", "Speedup over kiln eager per workload"),
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
        print(f"report: no plots ({e}); matplotlib comes with the benchmark's venv", file=sys.stderr)

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
