"""Weights between PyTorch and kiln, both ways, for the GPT of
torch_gpt.py and examples/gpt.h (the same architecture):

  torch -> kiln  torch_gpt.py's model, seeded, saves its state_dict with
                 safetensors.torch.save_file; examples/gpt_weights loads it
                 into gpt.h's GPT (kiln_load_tensors_into) and computes the
                 logits of fixed tokens, eager and compiled; they must equal
                 PyTorch's.
  kiln -> torch  gpt_weights initializes a model with gpt_init, saves it with
                 kiln_save_tensors and writes its logits; PyTorch loads the
                 file with safetensors.torch.load_file into its model
                 (load_state_dict) and must reproduce them.

The file holds PyTorch's keys ("blocks.1.attn_w"); examples/gpt_weights.c
says how they map to gpt.h's params (no transposes, the head tied to wte).
Equal means max |kiln - torch| <= TOL * max |torch| in f32.

  make torch-roundtrip       (build/venv from bench/venv.sh; exit 1 on a mismatch)
  python bench/torch_roundtrip.py BUILD_DIR
"""

import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402

TOL = 1e-4
B, T = 2, torch_gpt.BLOCK_SIZE  # a full context: every wpe row is used
TORCH_SEED, KILN_SEED, IDX_SEED = 0, 7, 3


def torch_logits(model, idx):
    with torch.no_grad():
        return model.hidden(idx) @ model.wte.t()


def compare(what, got, want):
    if got.shape != want.shape:
        print(f"{what}: shape {tuple(got.shape)}, PyTorch's {tuple(want.shape)}")
        return False
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    ok = err <= TOL * scale
    print(f"{what}: max |diff| {err:.3g}, max |logit| {scale:.3g}, relative {err / scale:.3g} "
          f"({'ok' if ok else 'MISMATCH'}, tolerance {TOL:g})")
    return ok


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr}")


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    prog = os.path.join(build, "examples", "gpt_weights")
    if not os.access(prog, os.X_OK):
        sys.exit(f"{prog} not found: build kiln with its examples first")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    GPT = torch_gpt.models(torch)[0]
    idx = torch.randint(0, torch_gpt.VOCAB, (B, T), generator=torch.Generator().manual_seed(IDX_SEED))
    ok = True
    with tempfile.TemporaryDirectory() as d:
        p = lambda name: os.path.join(d, name)  # noqa: E731
        save_file({"idx": idx}, p("idx.safetensors"))

        # torch -> kiln
        torch.manual_seed(TORCH_SEED)
        model = GPT().eval()
        save_file(model.state_dict(), p("torch.safetensors"))
        run([prog, "load", p("torch.safetensors"), p("idx.safetensors"), p("out_torch.safetensors")])
        out = load_file(p("out_torch.safetensors"))
        want = torch_logits(model, idx)
        ok &= compare("torch -> kiln, eager", out["logits"], want)
        ok &= compare("torch -> kiln, compiled", out["logits_compiled"], want)

        # kiln -> torch
        run([prog, "save", str(KILN_SEED), p("kiln.safetensors"), p("idx.safetensors"), p("out_kiln.safetensors")])
        weights = load_file(p("kiln.safetensors"))
        model2 = GPT().eval()
        missing, unexpected = model2.load_state_dict(weights, strict=False)
        # every weight came from kiln's file, and only the mask buffer (not a weight) did not
        if missing != ["mask"] or unexpected:
            print(f"kiln -> torch: keys missing {missing}, unexpected {unexpected} (want only the mask missing)")
            ok = False
        out = load_file(p("out_kiln.safetensors"))
        ok &= compare("kiln -> torch", torch_logits(model2, idx), out["logits"])
        # the two directions did not merely agree on one model: the seeds differ
        if torch.equal(model2.wte, model.wte):
            print("kiln -> torch: kiln's wte equals torch's (the seeds should differ)")
            ok = False
    print("torch_roundtrip:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
