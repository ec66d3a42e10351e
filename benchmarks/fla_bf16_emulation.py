"""Where the H200's Gated DeltaNet dk error comes from, on the CPU: fla's whole gated delta rule
(forward and backward, documents, an initial state, grouped q/k heads: the case of
tests/kernels/test_delta_rule.py::test_fla_kernels_match_the_chunked_form_on_gpu) run through
Triton's interpreter in fp32, against torchloom's chunked form.

    pip install fla-core && python benchmarks/fla_bf16_emulation.py     # about 3 minutes

Rows: fla's kernels in fp32 as they are ("fp32"); then with every tensor fla keeps in bf16 on a
GPU (given bf16 q, k, v, beta: each kernel's outputs but the fp32 states, dg and dh0) rounded
to bf16 between kernels ("bf16 storage"), with fla's own dqkwg kernel and with torchloom's
(fla_backend: its Triton kernel, its PyTorch form); then the same rounding for one group of
fla's functions at a time; then torchloom's step with its dk scaled by 0.8 (a broken step the
GPU test must fail). Errors: norm of the difference over the reference's, as the test; for dq
and dk also the test's allowance (2% of the gradient plus 5e-3 of the gradient at the
normalised q/k over |q|, |k|: what fla stores in bf16 before its l2norm backward).

Only storage is rounded: the casts inside the kernels stay fp32, which Triton's interpreter
cannot do otherwise (a bf16 ``tl.dot`` there returns garbage). fla's kernels need two changes
to run in the interpreter at all: their autotuners are pinned to the first config (there is no
GPU to time them), and ``i.to(tl.int64)`` on a loop counter (a Python int there) is rewritten as
``tl.cast``; this script applies the second to a temporary copy of the installed fla.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

# fla's functions that gated_delta_rule/chunk.py calls, with the outputs that stay fp32 on a GPU
KEEP_FP32 = {
    "l2norm_fwd": (1,), "l2norm_bwd": (), "chunk_gated_delta_rule_fwd_intra": (),
    "recompute_w_u_fwd": (), "chunk_gated_delta_rule_fwd_h": (2,), "chunk_fwd_o": (),
    "chunk_bwd_dv_local": (), "chunk_gated_delta_rule_bwd_dhu": (1,), "chunk_bwd_dqkwg": (3,),
    "prepare_wy_repr_bwd": (3,), "chunk_gated_delta_rule_bwd": (4, 5, 6, 7),
}  # fmt: skip
GROUPS = {
    "l2norm": ("l2norm_fwd", "l2norm_bwd"),
    "wy forward": ("chunk_gated_delta_rule_fwd_intra", "recompute_w_u_fwd"),
    "states, output": ("chunk_gated_delta_rule_fwd_h", "chunk_fwd_o"),
    "dv, dh": ("chunk_bwd_dv_local", "chunk_gated_delta_rule_bwd_dhu"),
    "dqkwg, wy backward": ("chunk_bwd_dqkwg", "prepare_wy_repr_bwd"),
    "backward's outputs": ("chunk_gated_delta_rule_bwd",),
}


def interpretable_fla() -> Path:
    """A copy of the installed fla whose loop counters' ``.to(tl.intN)`` read ``tl.cast``."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        sys.exit("fla-core is not installed: pip install fla-core")
    root = Path(tempfile.mkdtemp(prefix="fla_interpret_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copytree(Path(spec.origin).parent, root / "fla")
    counter = re.compile(r"\b(i_[a-z0-9_]*)\.to\(tl\.(int64|int32)\)")
    for path in (root / "fla").rglob("*.py"):
        text = path.read_text()
        if counter.search(text):
            path.write_text(counter.sub(r"tl.cast(\1, tl.\2)", text))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("outputs/fla_bf16_emulation.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(interpretable_fla()))
    import torch
    import torch.nn.functional as F
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner.prune_configs = lambda self, *a, **k: self.configs[:1]
    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None: [1.0] * 3)
    import fla.ops.gated_delta_rule.chunk as fla_chunk

    # benchmarks/fla_backend.py: the case and the step switch of its GPU comparison
    from fla_backend import GRADS, STEP_FORMS, gdn_case, relative_errors, use_step

    from torchloom.kernels import fla_backend
    from torchloom.kernels.delta_rule import _delta_rule_fla, delta_rule

    originals = {name: getattr(fla_chunk, name) for name in KEEP_FP32}
    step = fla_backend.chunk_bwd_dqkwg
    fla_backend.register()

    def bf16(x):
        is_float = isinstance(x, torch.Tensor) and x.is_floating_point()
        return x.to(torch.bfloat16).float() if is_float else x

    def rounding(name: str):
        def call(*a, **k):
            out = originals[name](*a, **k)
            if not isinstance(out, tuple):
                return bf16(out)
            return tuple(o if i in KEEP_FP32[name] else bf16(o) for i, o in enumerate(out))

        return call

    inputs, state, docs = gdn_case(torch.device("cpu"), torch.float32)

    def run(impl: str, round_inputs: bool = False) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in inputs]
        if impl == "torch":
            o, s = delta_rule(*leaves, state, impl="torch", doc_ids_BT=docs, normalize_qk=True)
        else:  # as the layers call fla: q, k and beta in v's dtype (v is bf16 already), g fp32
            q_, k_, v_, g_, beta_ = leaves
            if round_inputs:
                q_, k_, beta_ = bf16(q_), bf16(k_), bf16(beta_)
            o, s = _delta_rule_fla(q_, k_, v_, g_, beta_, state, None, docs, normalize_qk=True)
            o = bf16(o) if round_inputs else o
        (o.float().square().sum() + s.square().sum()).backward()
        return [x.detach() for x in [o, s] + [x.grad for x in leaves]]

    reference = run("torch")
    q, k, *rest = inputs
    normalised = [F.normalize(x, dim=-1).requires_grad_() for x in (q, k)]
    o, s = delta_rule(*normalised, *rest, state, impl="torch", doc_ids_BT=docs)
    (o.square().sum() + s.square().sum()).backward()
    rounded = {n: x.grad / raw.norm(dim=-1, keepdim=True)
               for n, x, raw in zip(("dq", "dk"), normalised, (q, k))}  # fmt: skip

    def row(name: str, step_form: str, groups: tuple[str, ...], dk_scale: float = 1.0) -> dict:
        for function, original in originals.items():
            chosen = any(function in GROUPS[group] for group in groups)
            setattr(fla_chunk, function, rounding(function) if chosen else original)
        use_step(step_form)

        def scaled_step(*a, **k):
            dq, dk, dw, dg = step(*a, **k)
            return dq, dk * dk_scale, dw, dg

        fla_backend.chunk_bwd_dqkwg = scaled_step
        got = run("fla", round_inputs=bool(groups))
        errors = relative_errors(got, reference)
        allowed = {n: 2e-2 + 5e-3 * float(rounded[n].norm() / reference[GRADS.index(n)].norm())
                   for n in rounded}  # fmt: skip
        result = {"row": name, "step": step_form, "rounded": list(groups), "rel_error": errors,
                  "allowed": allowed, "passes": all(errors[n] < a for n, a in allowed.items())}  # fmt: skip
        print(result, flush=True)
        return result

    everything = tuple(GROUPS)
    rows = [row("fp32", form, ()) for form in STEP_FORMS]
    rows += [row("bf16 storage", form, everything) for form in STEP_FORMS]
    rows += [row(f"bf16: {group} only", "fla", (group,)) for group in GROUPS]
    rows.append(row("bf16 storage, step dk x 0.8", "torchloom-triton", everything, 0.8))

    print(f"\n{'row':<30} {'step':<17} " + " ".join(f"{n:>7}" for n in GRADS) + "  test")
    for r in rows:
        errors = " ".join(f"{r['rel_error'][n]:>7.1e}" for n in GRADS)
        print(f"{r['row']:<30} {r['step']:<17} {errors}  {'pass' if r['passes'] else 'FAIL'}")
    allowed = rows[0]["allowed"]
    print(f"the GPU test allows dq {allowed['dq']:.1e}, dk {allowed['dk']:.1e}, the rest 2.0e-02")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "torch": torch.__version__,
        "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
