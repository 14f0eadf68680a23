"""What the benchmark ran on: CPU (its model and vector width), cores, memory,
OS, compiler, LLVM, OpenBLAS (its build and the core type it picked), the
Python libraries, and the load at the time.

    python3 bench/machine.py [--build DIR] [--json PATH]

run.sh calls it before the benchmarks (so the load average is the one they
started under); report.py reads the JSON. Every probe is best-effort: what
cannot be found is left out, never fatal.
"""

import argparse
import ctypes
import ctypes.util
import datetime
import json
import os
import platform
import re
import subprocess
import sys


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def run(*cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu():
    info = {}
    text = read("/proc/cpuinfo")
    for key, field in (("model name", "cpu_model"), ("flags", "flags"), ("cpu family", "family"),
                       ("model", "model")):
        m = re.search(rf"^{key}\s*:\s*(.*)$", text, re.M)
        if m:
            info[field] = m.group(1).strip()
    flags = set(info.pop("flags", "").split())
    info["isa"] = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
                   if f in flags]
    info["vector"] = vector_width(flags)
    info["logical_cpus"] = os.cpu_count()
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    lscpu = run("lscpu")
    for key, field in (("Core(s) per socket", "cores_per_socket"), ("Socket(s)", "sockets"),
                       ("Thread(s) per core", "threads_per_core"), ("Hypervisor vendor", "hypervisor"),
                       ("L2 cache", "l2"), ("L3 cache", "l3")):
        m = re.search(rf"^{re.escape(key)}:\s*(.*)$", lscpu, re.M)
        if m:
            info[field] = m.group(1).strip()
    m = re.search(r"^MemTotal:\s*(\d+) kB", read("/proc/meminfo"), re.M)
    if m:
        info["mem_gib"] = round(int(m.group(1)) / 2**20, 1)
    return info


def vector_width(flags):
    """The widest SIMD the CPU reports, as the report names it in each table."""
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    if "avx" in flags:
        return "AVX"
    if "sve" in flags:
        return "SVE"
    if "asimd" in flags:
        return "NEON"
    return "SSE" if "sse2" in flags else "scalar"


def system():
    info = {"kernel": platform.release(), "python": platform.python_version()}
    m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', read("/etc/os-release"), re.M)
    if m:
        info["os"] = m.group(1)
    info["loadavg_start"] = read("/proc/loadavg").split()[:3]
    info["date_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return info


def build(build_dir):
    info = {}
    cache = read(os.path.join(build_dir, "CMakeCache.txt"))
    m = re.search(r"^CMAKE_C_COMPILER:\w+=(.*)$", cache, re.M)
    cc = m.group(1) if m else "cc"
    info["cc"] = run(cc, "--version").splitlines()[0] if run(cc, "--version") else cc
    m = re.search(r"^CMAKE_BUILD_TYPE:\w+=(.*)$", cache, re.M)
    if m:
        info["build_type"] = m.group(1)
    m = re.search(r"^LLVM_DIR:\w+=(.*)$", cache, re.M)
    llvm_config = "llvm-config"
    if m:
        guess = os.path.join(m.group(1).split("/lib/cmake")[0], "bin", "llvm-config")
        if os.path.exists(guess):
            llvm_config = guess
    info["llvm"] = run(llvm_config, "--version")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = run("git", "-C", root, "rev-parse", "--short", "HEAD")
    if commit:
        dirty = run("git", "-C", root, "status", "--porcelain", "--untracked-files=no")
        info["commit"] = commit + ("+changes" if dirty else "")
    return info


def openblas():
    """OpenBLAS's build string and the kernels it picked here (the same library
    kiln_bench links, under the same environment)."""
    info = {"OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE")}
    for name in ("libopenblas.so.0", ctypes.util.find_library("openblas")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn, field in (("openblas_get_config", "config"), ("openblas_get_corename", "core")):
            f = getattr(lib, fn, None)
            if f:
                f.restype = ctypes.c_char_p
                info[field] = f().decode(errors="replace").strip()
        break
    return info


def python_libs():
    info = {}
    for mod in ("numpy", "matplotlib"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - missing, or broken: either way not there
            info[mod] = None
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="the build directory (for CMakeCache.txt)")
    ap.add_argument("--json", help="write here (default: stdout)")
    args = ap.parse_args()
    doc = {"cpu": cpu(), "system": system(), "build": build(args.build), "openblas": openblas(),
           "python_libs": python_libs(),
           "env": {k: os.environ[k] for k in ("KILN_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_L2_SIZE",
                                              "XLA_FLAGS") if k in os.environ}}
    text = json.dumps(doc, indent=2) + "\n"
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
