"""Every contender on each workload, side by side, sample by sample, in one run.

    build/venv/bin/python bench/side_by_side.py [--threads 1,2] [--only W1,W3]
        [--modes kiln_eager,...] [--kiln build/bench/kiln_bench] [--json PATH]
        [--compile-budget 600] [--env-note TEXT]

The contenders (MODES): kiln eager and kiln compiled (through `kiln_bench
--serve`, one child process each, which times each call in C), PyTorch eager (op by
op), PyTorch's fused ops, torch.compile in its default mode and in
mode="max-autotune-no-cudagraphs", and JAX's jax.jit. They are defined in
bench/workloads.c, bench/gpt.c, bench/lstm.c, bench/llama.c and bench/resnet.c (kiln),
bench/torch_workloads.py, bench/torch_gpt.py, bench/torch_lstm.py, bench/torch_llama.py and
bench/torch_resnet.py (PyTorch),
bench/jax_workloads.py and bench/jax_gpt.py (JAX); a workload one side lacks, or a library that does not import, leaves
those cells empty with the reason in the JSON's meta.errors.

For each workload and thread count, every contender is built first (the
compilers compile: their compile times are measured then, from empty
caches), warmed up, and then timed in rounds: each round calls every
contender once, starting one further along the list each round, so that a
load spike, or one library's threads still spinning after its call, falls
on all of them alike. Reported per contender: the median and least ms per
call, and the median over rounds of its time over kiln compiled's (and
over kiln eager's) in the same round.

Thread counts: kiln's pool and OpenBLAS (kiln_set_num_threads), PyTorch's
intra-op threads (torch.set_num_threads, which the code torch.compile
generates uses too) and XLA's CPU thread pool (one thread per core; it
cannot be set to another count, so JAX runs only at the count that equals
the cores) are set to the same N. At 1 thread only the eager contenders
run (kiln eager, PyTorch eager and fused ops), as the report shows them.

The JSON is {"meta": {...}, "rows": [{"name", "threads", "samples",
"<mode>_ms", "<mode>_min_ms", "<mode>_over_kiln_compiled",
"<mode>_over_kiln_eager", "<mode>_compile_ms", "<mode>_samples_ms": [...]}]}.
"""

import argparse
import gc
import json
import math
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = ("kiln_eager", "kiln_compiled", "torch_eager", "torch_builtin", "torch_compile",
         "torch_compile_max", "jax_jit")
ONE_THREAD_MODES = ("kiln_eager", "torch_eager", "torch_builtin")
TORCH_COMPILE_MODES = {"torch_compile": None, "torch_compile_max": "max-autotune-no-cudagraphs"}

WARMUP = 5
MIN_SAMPLES = 20
MAX_SAMPLES = 1000
SAMPLE_BUDGET_S = 0.6  # timed work per contender, as kiln_bench
# A workload whose round takes longer than this gets bench/gpt.c's counts (W8, W9)
SLOW_ROUND_S = 0.5
SLOW_WARMUP, SLOW_MIN_SAMPLES, SLOW_MAX_SAMPLES, SLOW_BUDGET_S = 3, 5, 200, 0.75
FIRST_CALLS = 2        # torch.compile compiles on its first calls (the backward on the first backward)


class Timeout(BaseException):
    """A compile ran past its budget (a BaseException: no library's `except Exception` eats it)."""


def within(seconds, fn):
    """fn(), or Timeout once it has run `seconds`."""
    def ring(signum, frame):
        raise Timeout()
    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(max(1, int(seconds)))
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def short_error(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# ---- kiln, through kiln_bench --serve -----------------------------------------

class KilnError(Exception):
    pass


class Kiln:
    """A kiln_bench --serve child: one request, one answer line (serve.c)."""

    def __init__(self, binary):
        self.proc = subprocess.Popen([binary, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def ask(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise KilnError(f"kiln_bench --serve exited (code {self.proc.poll()})")
        answer = answer.rstrip("\n")
        if answer.startswith("err"):
            raise KilnError(answer[4:])
        return answer

    def workloads(self):
        self.proc.stdin.write("list\n")
        self.proc.stdin.flush()
        out = []
        for line in self.proc.stdout:
            if line.strip() == "end":
                return out
            out.append(tuple(line.split()))
        raise KilnError("kiln_bench --serve exited")

    def run(self, mode):
        return float(self.ask(f"run {mode}").split()[1])

    def quit(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# ---- the libraries ------------------------------------------------------------

def load_torch(threads):
    try:
        import torch
        import torch_workloads
    except ImportError as e:
        return None, None, f"PyTorch did not import ({e})"
    import logging
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:  # max-autotune prints every GEMM's choices and timings to stderr: keep the run's log readable
        import torch._inductor.config
        import torch._inductor.select_algorithm
        torch._inductor.select_algorithm.PRINT_AUTOTUNE = False
        torch._inductor.config.max_autotune_report_choices_stats = False
    except (ImportError, AttributeError):
        pass
    return torch, torch_workloads, None


def load_jax(threads, cores):
    if threads != cores:
        return None, None, (f"JAX's CPU thread pool has one thread per core ({cores}); "
                            f"it runs only at {cores} threads")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=" + ("true" if threads > 1 else "false"))
    try:
        import jax
        import jax_workloads
    except ImportError as e:
        return None, None, f"JAX did not import ({e})"
    jax.config.update("jax_platforms", "cpu")
    return jax, jax_workloads, None


def versions(torch, jax):
    v = {"python": sys.version.split()[0]}
    for mod in ("numpy", "matplotlib"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = None
    if torch:
        v["torch"] = torch.__version__
        try:
            v["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        except AttributeError:
            pass
        cfg = torch.__config__.show()
        v["torch_blas"] = ("MKL" if "BLAS_INFO=mkl" in cfg else "OpenBLAS" if "BLAS_INFO=open" in cfg
                           else None)
        v["torch_onednn"] = bool(torch.backends.mkldnn.is_available())
    if jax:
        import jaxlib
        v["jax"] = jax.__version__
        v["jaxlib"] = jaxlib.__version__
        v["xla_flags"] = os.environ.get("XLA_FLAGS")
    return v


# ---- one workload -------------------------------------------------------------

class Run:
    """The contenders of one workload at one thread count."""

    def __init__(self, name, threads, per):
        self.name, self.threads, self.per = name, threads, per
        self.calls = {}     # mode -> fn() returning the ms of one call
        self.compile = {}   # mode -> compile ms
        self.first = {}     # mode -> ms of torch.compile's first calls
        self.errors = {}    # mode -> reason

    def python(self, mode, step):
        per = self.per

        def call():
            t0 = time.perf_counter()
            step()
            return 1e3 * (time.perf_counter() - t0) / per
        self.calls[mode] = call


def build_kiln(run, kilns, modes):
    """kilns: {"kiln_eager": Kiln, "kiln_compiled": Kiln}, one child each, so
    that eager's allocations (a ResNet step frees and maps back 1.3 GB) do
    not share a heap and its page faults with the compiled side."""
    for m, kiln in kilns.items():
        if m not in modes:
            continue
        try:
            kiln.ask(f"threads {run.threads}")
            kiln.ask(f"open {run.name}")  # by name: one id may have several rows (W13)
            if m == "kiln_compiled":
                _, compile_ms, _ = kiln.ask("prepare").split()
                run.compile["kiln_compiled"] = float(compile_ms)
        except KilnError as e:
            run.errors[m] = str(e)
            continue
        run.calls[m] = (lambda k, what: lambda: k.run(what))(kiln, m.split("_")[1])


def build_torch(run, torch, maker, modes, budget):
    try:
        builders = maker()
    except Exception as e:  # noqa: BLE001 - a workload that cannot be made is reported, not fatal
        for m in modes:
            if m.startswith("torch"):
                run.errors[m] = short_error(e)
        return
    from torch._inductor.utils import fresh_cache
    for mode in modes:
        if not mode.startswith("torch"):
            continue
        key = mode.split("_", 1)[1]
        try:
            if key in ("eager", "builtin"):
                if key not in builders:
                    run.errors[mode] = "no fused form of this workload"
                    continue
                run.python(mode, builders[key]())
                continue
            if "compile" not in builders:
                run.errors[mode] = "no torch.compile form of this workload"
                continue
            cmode = TORCH_COMPILE_MODES[mode]

            def wrap(m, **kw):
                return torch.compile(m, mode=cmode, **kw)

            def compile_now():
                # from empty caches (inductor's on-disk and in-memory code caches), as kiln's cold compile
                with fresh_cache():
                    step = builders["compile"](wrap)
                    t0 = time.perf_counter()
                    for _ in range(FIRST_CALLS):
                        step()
                    return step, 1e3 * (time.perf_counter() - t0)
            step, first = within(budget, compile_now)
            run.python(mode, step)
            run.first[mode] = first
        except Timeout:
            run.errors[mode] = f"skipped: its compile took over {budget:.0f} s"
            torch._dynamo.reset()
        except Exception as e:  # noqa: BLE001
            run.errors[mode] = short_error(e)


def build_jax(run, maker, budget):
    try:
        step, ms = within(budget, maker())
        run.python("jax_jit", step)
        run.compile["jax_jit"] = ms
    except Timeout:
        run.errors["jax_jit"] = f"skipped: its compile took over {budget:.0f} s"
    except Exception as e:  # noqa: BLE001
        run.errors["jax_jit"] = short_error(e)


def time_rounds(run):
    """Interleaved samples: {mode: [ms per round]}. The warm-up rounds tell
    how long a round takes, and so how many rounds fit the budget."""
    modes = list(run.calls)
    k = len(modes)

    def one_round():
        t0 = time.perf_counter()
        for m in modes:
            run.calls[m]()
        return time.perf_counter() - t0
    slow = one_round() > SLOW_ROUND_S
    for _ in range((SLOW_WARMUP if slow else WARMUP) - 2):
        one_round()
    per_round = one_round()
    budget, lo, hi = ((SLOW_BUDGET_S, SLOW_MIN_SAMPLES, SLOW_MAX_SAMPLES) if slow
                      else (SAMPLE_BUDGET_S, MIN_SAMPLES, MAX_SAMPLES))
    n = max(lo, min(hi, int(k * budget / max(per_round, 1e-9))))
    ms = {m: [] for m in modes}
    for r in range(n):
        for i in range(k):
            m = modes[(r + i) % k]
            ms[m].append(run.calls[m]())
    return ms


def summarize(run, ms):
    row = {"name": run.name, "threads": run.threads, "samples": len(next(iter(ms.values()), []))}
    for m, v in ms.items():
        row[f"{m}_ms"] = median(v)
        row[f"{m}_min_ms"] = min(v)
        row[f"{m}_samples_ms"] = [float(f"{x:.5g}") for x in v]
        for ref in ("kiln_compiled", "kiln_eager"):
            if ref in ms and m != ref:
                row[f"{m}_over_{ref}"] = median([a / b for a, b in zip(v, ms[ref]) if b > 0])
    for m, c in run.compile.items():
        row[f"{m}_compile_ms"] = c
    for m, first in run.first.items():  # torch.compile: its first calls beyond the steady state
        if f"{m}_ms" in row:
            row[f"{m}_compile_ms"] = max(0.0, first - FIRST_CALLS * row[f"{m}_ms"] * run.per)
    return row


# ---- main -----------------------------------------------------------------------

def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) and math.isfinite(v) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", help="comma list of thread counts (default: 1,N with N the usable cores)")
    ap.add_argument("--only", help="comma list of workload ids or names (W1,W3)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--kiln", default="build/bench/kiln_bench", help="the kiln_bench binary")
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--compile-budget", type=float, default=600,
                    help="seconds a compiler may take on one workload before it is skipped (default 600)")
    ap.add_argument("--env-note", default="", help="how this Python was set up, for the report")
    args = ap.parse_args()

    cores = len(os.sched_getaffinity(0))
    try:
        threads = [int(t) for t in (args.threads or f"1,{cores}").split(",")]
        if any(t < 1 for t in threads):
            raise ValueError
    except ValueError:
        ap.error(f"--threads wants positive integers, got {args.threads}")
    threads = sorted(set(threads))
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode {bad[0]} (modes: {', '.join(MODES)})")
    only = set(args.only.split(",")) if args.only else None
    top = max(threads)
    unavailable = {}  # mode -> why it has no cells at all

    torch, torch_w, why = load_torch(top)
    if why:
        for m in modes:
            if m.startswith("torch"):
                unavailable[m] = why
    jax = jax_w = None
    if "jax_jit" in modes:
        jax, jax_w, why = load_jax(top, cores)
        if why:
            unavailable["jax_jit"] = why
    kilns, kiln_ids = {}, []
    for m in ("kiln_eager", "kiln_compiled"):
        if m not in modes:
            continue
        try:
            kilns[m] = Kiln(args.kiln)
            kiln_ids = kilns[m].workloads()
        except (OSError, KilnError) as e:
            kilns.pop(m, None)
            unavailable[m] = f"kiln_bench --serve failed ({e})"

    # every workload any side has, in order: W1..W9, then the others' additions (W13, W14)
    table = {}
    for wid, name in kiln_ids:
        table.setdefault(name, {"id": wid})
    for lib, side in (("torch", torch_w), ("jax", jax_w)):
        for wid, name, maker in (side.workloads() if side else []):
            table.setdefault(name, {"id": wid})[lib] = maker

    from report import order
    names = [n for n in sorted(table, key=order)
             if not only or n in only or table[n]["id"] in only]
    if not names:
        print(f"no workload matches --only {args.only}", file=sys.stderr)
        return 2

    meta = {"threads": threads, "cores": cores, "modes": modes, "unavailable": unavailable,
            "versions": versions(torch, jax), "env_note": args.env_note,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "compile_budget_s": args.compile_budget, "errors": {}}
    import torch_gpt
    import torch_llama
    per_call = {**torch_gpt.PER, **torch_llama.PER}  # generation rows: ms per token

    # the first compile in a process starts the compiler itself (imports,
    # worker processes, headers): paid here, before any workload's count
    if torch and any(m in modes for m in TORCH_COMPILE_MODES):
        t0 = time.perf_counter()
        torch.set_num_threads(top)
        torch.compile(lambda x: x * 2 + 1)(torch.ones(8))
        meta["torch_compile_startup_ms"] = 1e3 * (time.perf_counter() - t0)
    if jax:
        t0 = time.perf_counter()
        jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(8)))
        meta["jax_startup_ms"] = 1e3 * (time.perf_counter() - t0)

    print(f"{'workload':<18} {'threads':>7} {'rounds':>6} " + " ".join(f"{m:>17}" for m in modes), flush=True)
    rows = []
    for name in names:
        entry = table[name]
        for n in threads:
            want = [m for m in modes if m not in unavailable and (n == top or m in ONE_THREAD_MODES)]
            run = Run(name, n, per_call.get(name, 1))
            if torch:
                torch.set_num_threads(n)
                torch.manual_seed(0)
            if any(m.startswith("kiln") for m in want):
                if kilns and any(w[1] == name for w in kiln_ids):
                    build_kiln(run, kilns, want)
                else:
                    for m in want:
                        if m.startswith("kiln"):
                            run.errors[m] = "no kiln form of this workload"
            if torch and any(m.startswith("torch") for m in want):
                if "torch" in entry:
                    build_torch(run, torch, entry["torch"], want, args.compile_budget)
                else:
                    for m in want:
                        if m.startswith("torch"):
                            run.errors[m] = "no PyTorch form of this workload"
            if jax and "jax_jit" in want:
                if "jax" in entry:
                    build_jax(run, entry["jax"], args.compile_budget)
                else:
                    run.errors["jax_jit"] = "no JAX form of this workload"
            try:
                ms = time_rounds(run) if run.calls else {}
            except KilnError as e:
                run.errors.update({m: str(e) for m in run.calls if m.startswith("kiln")})
                run.calls = {m: c for m, c in run.calls.items() if not m.startswith("kiln")}
                ms = time_rounds(run) if run.calls else {}
            row = summarize(run, ms)
            for m, why in run.errors.items():
                meta["errors"].setdefault(m, {})[f"{name}@{n}"] = why
                print(f"  {name}, {n} thread(s): {m}: {why}", file=sys.stderr, flush=True)
            rows.append(row)
            print(f"{name:<18} {n:>7} {row['samples']:>6} "
                  + " ".join(f"{fmt(row.get(m + '_ms')):>17}" for m in modes), flush=True)
            for kiln in kilns.values():
                try:
                    kiln.ask("close")
                except KilnError:
                    pass
            run = ms = None
            if torch:
                torch._dynamo.reset()
            gc.collect()
    for kiln in kilns.values():
        kiln.quit()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
