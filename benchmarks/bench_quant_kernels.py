"""Matmul kernels for one forward pass of the 1.5B demo target's projections, side by side.

Random weights of the model's shapes (28 layers of q/k/v, o, gate/up, down, plus the LM head),
3.1 GB in bf16, so every call streams its weight from memory as in real decoding (the L3
cache is 260 MB here). For each row count (1 = plain decoding, k + 1 = a verify pass) it
times the whole sequence of matmuls with each kernel, interleaved, median of --repeats.

    python benchmarks/bench_quant_kernels.py --rows 1,2,4,6,8

Kernels: bf16 oneDNN with prepacked weights (what dense models use), torch's
``_weight_int8pack_mm``, specdecode's native int8 kernel with fp32 activations and with
int16-blocked activations (the default), and torch's int4 kernel (group 32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

LAYERS, HIDDEN, INTER, QKV, VOCAB = 28, 1536, 8960, 2048, 151936
GROUP = 32


def shapes() -> list[tuple[int, int]]:
    return [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]


def make_ops(kind: str) -> list:
    from specdecode.quant import native

    ops = []
    for n, k in shapes():
        if kind == "bf16":
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=torch.bfloat16), 1)
            ops.append(lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
            continue
        if kind == "int4":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
            sz = torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16)
            ops.append(lambda x, p=packed, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, GROUP, sz))
            continue
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = torch.rand(n)
        if kind == "int8-torch":
            sb = s.to(torch.bfloat16)
            ops.append(lambda x, w=w, sb=sb: torch.ops.aten._weight_int8pack_mm(x, w, sb))
        else:
            blocked = kind == "int8-native"

            def op(x: torch.Tensor, w: torch.Tensor = w, s: torch.Tensor = s, blocked: bool = blocked) -> torch.Tensor:
                native.BLOCKED_INT16_ACTIVATIONS = blocked
                return native.int8_gemm(x, w, s, None)

            ops.append(op)
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,6")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels", default="bf16,int8-torch,int8-native-fp32,int8-native,int4")
    args = parser.parse_args()
    torch.manual_seed(0)
    kinds = args.kernels.split(",")
    ops = {kind: make_ops(kind) for kind in kinds}
    dims = shapes()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print("rows | " + " | ".join(kinds) + " | (ms per forward's matmuls; ratio to bf16)")
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {HIDDEN: torch.randn(rows, HIDDEN, dtype=torch.bfloat16), INTER: torch.randn(rows, INTER, dtype=torch.bfloat16)}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for repeat in range(args.repeats + 1):
            for kind in kinds:
                started = time.perf_counter()
                for (_, k), op in zip(dims, ops[kind]):
                    op(inputs[k])
                if repeat:  # the first round warms up
                    times[kind].append(time.perf_counter() - started)
        medians = {kind: statistics.median(ts) * 1e3 for kind, ts in times.items()}
        base = medians.get("bf16")
        cells = [f"{medians[k]:.1f}" + (f" ({base / medians[k]:.2f}x)" if base else "") for k in kinds]
        print(f"{rows} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
