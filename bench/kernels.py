"""Do onnxruntime's fused CPU kernels pay off? Each com.microsoft fusion of the onnxruntime
target timed against the subgraph it replaces, alone, at realistic shapes.

``python bench/kernels.py [--runs 300] [--cases skip-layernorm gelu-erf ...] [--json FILE]``

A model-level latency regression (bench/latency.py, bench/why_slower.py) says *that* a fused
model is slower; this says *which kernel* is, at which shape, independent of the rest of the
model. Each case is a pair of one-node-deep models (unfused subgraph, fused kernel) built at
two sizes (the corpus's small transformer and BERT-base / ResNet-like), checked to compute the
same outputs, then timed in interleaved runs, both at the same optimization level: disabled
(each kernel as written) and ``all`` (what a user running onnxruntime's full optimizer gets:
it may fuse the unfused graph itself, or lay the fused one out differently). One thread, as
bench/latency.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import latency  # noqa: E402  (bench/latency.py: sessions and levels)

HEADER = '<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>'


@dataclass(frozen=True)
class Case:
    """One fusion: the rule ids producing it and, per size, the unfused and fused graphs."""

    name: str
    rules: str
    build: Callable[[dict[str, int]], tuple[str, str]]
    """size -> (unfused graph text, fused graph text), onnx.parser syntax without header."""
    sizes: tuple[dict[str, int], ...]


TRANSFORMER_SIZES = ({"B": 2, "S": 32, "H": 256, "N": 4}, {"B": 1, "S": 128, "H": 768, "N": 12})
CONV_SIZES = ({"C": 16, "X": 24}, {"C": 64, "X": 56})


def _rows(s: dict[str, int]) -> str:
    return f"{s['B']},{s['S']},{s['H']}"


def _skip_norm(norm: str, fused: str, params: tuple[str, ...]
               ) -> Callable[[dict[str, int]], tuple[str, str]]:
    """Add + ``norm`` over the last axis against onnxruntime's ``fused`` skip kernel."""
    def build(s: dict[str, int]) -> tuple[str, str]:
        declared = "".join(f", float[{s['H']}] {p}" for p in params)
        sig = f"g (float[{_rows(s)}] x, float[{_rows(s)}] r{declared}) => (float[{_rows(s)}] y)"
        args = ", ".join(params)
        return (f"{sig} {{ t = Add(x, r) y = {norm}<axis=-1, epsilon=1e-5>(t, {args}) }}",
                f"{sig} {{ y = com.microsoft.{fused}<epsilon=1e-5>(x, r, {args}) }}")
    return build


def _rmsnorm(s: dict[str, int]) -> tuple[str, str]:
    sig = f"g (float[{_rows(s)}] x, float[{s['H']}] gamma) => (float[{_rows(s)}] y)"
    return (f"{sig} {{ two = Constant<value_float=2.0>() eps = Constant<value_float=1e-5>() "
            f"sq = Pow(x, two) ms = ReduceMean<axes=[-1]>(sq) me = Add(ms, eps) "
            f"rs = Sqrt(me) n = Div(x, rs) y = Mul(n, gamma) }}",
            f"{sig} {{ y = SimplifiedLayerNormalization<axis=-1, epsilon=1e-5>(x, gamma) }}")


def _unary(formula: str, fused: str) -> Callable[[dict[str, int]], tuple[str, str]]:
    def build(s: dict[str, int]) -> tuple[str, str]:
        sig = f"g (float[{_rows(s)}] x) => (float[{_rows(s)}] y)"
        return f"{sig} {{ {formula} }}", f"{sig} {{ {fused} }}"
    return build


GELU_ERF = ("half = Constant<value_float=0.5>() one = Constant<value_float=1.0>() "
            "rt2 = Constant<value_float=1.4142135>() d = Div(x, rt2) e = Erf(d) "
            "p = Add(e, one) m = Mul(x, p) y = Mul(m, half)")
GELU_TANH = ("half = Constant<value_float=0.5>() one = Constant<value_float=1.0>() "
             "c = Constant<value_float=0.044715>() k = Constant<value_float=0.7978846>() "
             "three = Constant<value_float=3.0>() x3 = Pow(x, three) cx3 = Mul(x3, c) "
             "in = Add(x, cx3) kin = Mul(in, k) t = Tanh(kin) p = Add(t, one) "
             "hx = Mul(x, half) y = Mul(hx, p)")
QUICK_GELU = "a = Constant<value_float=1.702>() ax = Mul(x, a) s = Sigmoid(ax) y = Mul(x, s)"


def _bias_gelu(s: dict[str, int]) -> tuple[str, str]:
    sig = f"g (float[{_rows(s)}] x0, float[{s['H']}] bias) => (float[{_rows(s)}] y)"
    return (f"{sig} {{ x = Add(x0, bias) {GELU_ERF} }}",
            f"{sig} {{ y = com.microsoft.BiasGelu(x0, bias) }}")


def _heads(s: dict[str, int]) -> str:
    return f"{s['B']},{s['N']},{s['S']},{s['H'] // s['N']}"


def _matmul_transpose_b(s: dict[str, int]) -> tuple[str, str]:
    sig = f"g (float[{_heads(s)}] q, float[{_heads(s)}] k) => " \
          f"(float[{s['B']},{s['N']},{s['S']},{s['S']}] y)"
    return (f"{sig} {{ kt = Transpose<perm=[0,1,3,2]>(k) y = MatMul(q, kt) }}",
            f"{sig} {{ y = com.microsoft.FusedMatMul<transB=1>(q, k) }}")


def _matmul_scale(s: dict[str, int]) -> tuple[str, str]:
    sig = f"g (float[{_heads(s)}] q, float[{_heads(s)}] k) => " \
          f"(float[{s['B']},{s['N']},{s['S']},{s['S']}] y)"
    return (f"{sig} {{ a = Constant<value_float=0.125>() kt = Transpose<perm=[0,1,3,2]>(k) "
            f"m = MatMul(q, kt) y = Mul(m, a) }}",
            f"{sig} {{ y = com.microsoft.FusedMatMul<transB=1, alpha=0.125>(q, k) }}")


def _attention(s: dict[str, int]) -> tuple[str, str]:
    b, n, seq, h = s["B"], s["N"], s["S"], s["H"]
    d = h // n
    sig = f"g (float[{b},{seq},{h}] q, float[{b},{seq},{h}] k, float[{b},{seq},{h}] v) => " \
          f"(float[{b},{seq},{h}] y)"
    unfused = (
        f"{sig} {{ shp = Constant<value_ints=[{b},{seq},{n},{d}]>() "
        f"back = Constant<value_ints=[{b},{seq},{h}]>() "
        f"sc = Constant<value_float={1 / d ** 0.5}>() "
        "q4 = Reshape(q, shp) k4 = Reshape(k, shp) v4 = Reshape(v, shp) "
        "qt = Transpose<perm=[0,2,1,3]>(q4) kt = Transpose<perm=[0,2,3,1]>(k4) "
        "vt = Transpose<perm=[0,2,1,3]>(v4) s0 = MatMul(qt, kt) s1 = Mul(s0, sc) "
        "p = Softmax<axis=-1>(s1) o = MatMul(p, vt) ot = Transpose<perm=[0,2,1,3]>(o) "
        "y = Reshape(ot, back) }")
    fused = f"{sig} {{ y = com.microsoft.MultiHeadAttention<num_heads={n}>(q, k, v) }}"
    return unfused, fused


def _rotary(s: dict[str, int]) -> tuple[str, str]:
    """Rotate-half RoPE on [B,N,S,D] heads; both sides read the same half-width cos/sin
    rows (the unfused graph concatenates each with itself, as the exporters' emb does)."""
    seq, d = s["S"], s["H"] // s["N"]
    sig = f"g (float[{_heads(s)}] x, float[1,1,{seq},{d // 2}] c, float[1,1,{seq},{d // 2}] sn)" \
          f" => (float[{_heads(s)}] y)"
    unfused = (
        f"{sig} {{ half = Constant<value_ints=[{d // 2},{d // 2}]>() "
        "cc = Concat<axis=-1>(c, c) ss = Concat<axis=-1>(sn, sn) "
        "x1, x2 = Split<axis=-1>(x, half) n2 = Neg(x2) r = Concat<axis=-1>(n2, x1) "
        "a = Mul(x, cc) m = Mul(r, ss) y = Add(a, m) }")
    fused = (
        f"{sig} {{ rows = Constant<value_ints=[{seq},{d // 2}]>() "
        "zero = Constant<value_ints=[0]>() c2 = Reshape(c, rows) s2 = Reshape(sn, rows) "
        "y = com.microsoft.RotaryEmbedding(x, zero, c2, s2) }")
    return unfused, fused


def _conv_sig(s: dict[str, int], extra: str = "") -> str:
    c, x = s["C"], s["X"]
    return (f"g (float[1,{c},{x},{x}] x, float[{c},{c},3,3] w, float[{c}] b{extra}) => "
            f"(float[1,{c},{x},{x}] y)")


def _conv_relu(s: dict[str, int]) -> tuple[str, str]:
    sig = _conv_sig(s)
    return (f"{sig} {{ c = Conv<pads=[1,1,1,1]>(x, w, b) y = Relu(c) }}",
            f"{sig} {{ y = com.microsoft.FusedConv<pads=[1,1,1,1], activation=\"Relu\">"
            f"(x, w, b) }}")


def _conv_add_relu(s: dict[str, int]) -> tuple[str, str]:
    c, x = s["C"], s["X"]
    sig = _conv_sig(s, f", float[1,{c},{x},{x}] z")
    return (f"{sig} {{ c = Conv<pads=[1,1,1,1]>(x, w, b) a = Add(c, z) y = Relu(a) }}",
            f"{sig} {{ y = com.microsoft.FusedConv<pads=[1,1,1,1], activation=\"Relu\">"
            f"(x, w, b, z) }}")


def _gemm_relu(s: dict[str, int]) -> tuple[str, str]:
    rows, h = s["B"] * s["S"], s["H"]
    sig = f"g (float[{rows},{h}] x, float[{h},{h}] w, float[{h}] b) => (float[{rows},{h}] y)"
    return (f"{sig} {{ m = Gemm(x, w, b) y = Relu(m) }}",
            f"{sig} {{ y = com.microsoft.FusedGemm<activation=\"Relu\">(x, w, b) }}")


CASES: tuple[Case, ...] = (
    Case("skip-layernorm", "ort-skip-layernorm*",
         _skip_norm("LayerNormalization", "SkipLayerNormalization", ("gamma", "beta")),
         TRANSFORMER_SIZES),
    Case("skip-rmsnorm", "ort-skip-rmsnorm",
         _skip_norm("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                    ("gamma",)), TRANSFORMER_SIZES),
    Case("rmsnorm", "ort-rmsnorm-simplified*", _rmsnorm, TRANSFORMER_SIZES),
    Case("gelu-erf", "ort-gelu-erf",
         _unary(GELU_ERF, "y = com.microsoft.Gelu(x)"), TRANSFORMER_SIZES),
    Case("fastgelu", "ort-fastgelu-tanh*",
         _unary(GELU_TANH, "y = com.microsoft.FastGelu(x)"), TRANSFORMER_SIZES),
    Case("biasgelu", "ort-biasgelu", _bias_gelu, TRANSFORMER_SIZES),
    Case("quickgelu", "ort-quickgelu",
         _unary(QUICK_GELU, "y = com.microsoft.QuickGelu<alpha=1.702>(x)"), TRANSFORMER_SIZES),
    Case("fusedmatmul-transb", "ort-fusedmatmul-transpose-b*", _matmul_transpose_b,
         TRANSFORMER_SIZES),
    Case("fusedmatmul-scale", "ort-fusedmatmul-scale*", _matmul_scale, TRANSFORMER_SIZES),
    Case("rotary-embedding", "ort-rotary-embedding*", _rotary, TRANSFORMER_SIZES),
    Case("multihead-attention", "ort-multihead-attention*", _attention, TRANSFORMER_SIZES),
    Case("fusedconv-relu", "ort-fusedconv-activation", _conv_relu, CONV_SIZES),
    Case("fusedconv-add-relu", "ort-fusedconv-add-activation", _conv_add_relu, CONV_SIZES),
    Case("fusedgemm-relu", "ort-fusedgemm-activation", _gemm_relu, TRANSFORMER_SIZES),
)


def _model(text: str) -> bytes:
    # No onnx checker: SimplifiedLayerNormalization is onnxruntime's, in the onnx domain.
    return onnx.parser.parse_model(f"{HEADER}\n{text}").SerializeToString()


def _feeds(blob: bytes, rng: np.random.Generator) -> dict[str, np.ndarray]:
    model = onnx.load_from_string(blob)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _session(blob: bytes, level: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = latency.LEVELS[level]
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])


def time_pair(unfused: bytes, fused: bytes, runs: int, level: str,
              feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Median microseconds of the unfused and the fused graph, both at optimization
    ``level``, timed in interleaved, shuffled rounds."""
    sessions = {"unfused": _session(unfused, level), "fused": _session(fused, level)}
    samples: dict[str, list[float]] = {k: [] for k in sessions}
    for sess in sessions.values():
        for _ in range(max(5, runs // 10)):
            sess.run(None, feeds)
    order = list(sessions)
    for _ in range(runs):
        random.shuffle(order)
        for key in order:
            start = time.perf_counter()
            sessions[key].run(None, feeds)
            samples[key].append(time.perf_counter() - start)
    return {k: float(np.median(v)) * 1e6 for k, v in samples.items()}


def check_same(unfused: bytes, fused: bytes, feeds: dict[str, np.ndarray]) -> float:
    """Largest absolute difference between the two graphs' outputs (a wrong case is caught
    before it is timed)."""
    a = _session(unfused, "disabled").run(None, feeds)[0]
    b = _session(fused, "disabled").run(None, feeds)[0]
    return float(np.max(np.abs(a - b)))


def run(cases: list[Case], runs: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        for size in case.sizes:
            unfused_text, fused_text = case.build(size)
            unfused, fused = _model(unfused_text), _model(fused_text)
            feeds = _feeds(unfused, rng)
            for name, array in feeds.items():
                if name in ("gamma", "w"):
                    feeds[name] = np.abs(array) + 0.5 if name == "gamma" else array * 0.1
            diff = check_same(unfused, fused, feeds)
            row = {"case": case.name, "rules": case.rules,
                   "size": ",".join(f"{k}={v}" for k, v in size.items()), "max_abs_diff": diff}
            for level in ("disabled", "all"):
                times = time_pair(unfused, fused, runs, level, feeds)
                row[f"unfused_{level}_us"] = times["unfused"]
                row[f"fused_{level}_us"] = times["fused"]
            row["ratio_disabled"] = row["fused_disabled_us"] / row["unfused_disabled_us"]
            row["ratio_all"] = row["fused_all_us"] / row["unfused_all_us"]
            rows.append(row)
            print(f"{case.name:22} {row['size']:24} unfused {row['unfused_disabled_us']:9.1f}"
                  f" fused {row['fused_disabled_us']:9.1f} us  fused/unfused "
                  f"{row['ratio_disabled']:5.2f}; at all: {row['unfused_all_us']:9.1f} "
                  f"{row['fused_all_us']:9.1f} us {row['ratio_all']:5.2f}  "
                  f"max diff {diff:.1e}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES])
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    chosen = [c for c in CASES if not args.cases or c.name in args.cases]
    print(f"onnxruntime {ort.__version__}, CPU, 1 thread, {args.runs} interleaved runs; "
          "ratio fused/unfused < 1 means the fusion pays off")
    rows = run(chosen, args.runs)
    if args.json:
        args.json.write_text(json.dumps({"onnxruntime": ort.__version__, "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
