"""The benchmark corpus: small transformer and CNN architectures exported from torch, plus the
onnx wheel's light models.

Run ``python bench/models.py`` to (re)build every model into ``bench/.models/``; other bench
scripts call :func:`corpus`, which builds only what is missing. The architectures are written
here in plain torch (no transformers, no downloaded weights): random weights from a fixed seed,
eval mode, fixed input shapes. Each is exported twice, as real users do:

* ``<name>-ts``: the TorchScript exporter (``dynamo=False``, opset 17);
* ``<name>-dynamo``: the dynamo exporter (``dynamo=True``, its default opset and its default
  onnxscript optimization). When it fails the reason is recorded and that entry is skipped.

Without torch only the light models are used (the script says how to install torch).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
MODELS_DIR = HERE / ".models"
MANIFEST = MODELS_DIR / "manifest.json"
LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
TS_OPSET = 17
SEED = 0
INSTALL_HINT = "torch is not installed: pip install torch==2.13.0 (CPU wheel) to add the " \
    "transformer/CNN exports; using the onnx wheel's light models only"

try:
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None


@dataclass
class Entry:
    """One model of the corpus: where it is, how it was made, what went wrong if anything."""

    name: str
    path: str | None
    source: str  # "torchscript", "dynamo" or "light"
    opset: int | None = None
    nodes: int | None = None
    seconds: float = 0.0
    error: str | None = None
    input_ranges: dict[str, list[int]] = field(default_factory=dict)


# --------------------------------------------------------------------------- architectures

if torch is not None:

    class SelfAttention(nn.Module):
        """Multi-head attention written out like HF's eager BERT/GPT-2 attention."""

        def __init__(self, hidden: int, heads: int, fused_qkv: bool = False):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            if fused_qkv:
                self.qkv = Conv1D(hidden, 3 * hidden)
            else:
                self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
            self.fused_qkv = fused_qkv
            self.out = Conv1D(hidden, hidden) if fused_qkv else nn.Linear(hidden, hidden)

        def split(self, x):
            b, s, _ = x.shape
            return x.view(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)

        def forward(self, x, bias):
            if self.fused_qkv:
                q, k, v = self.qkv(x).split(x.shape[-1], dim=2)
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            q, k, v = self.split(q), self.split(k), self.split(v)
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores + bias, dim=-1)
            ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
            return self.out(ctx.view(x.shape))

    class Conv1D(nn.Module):
        """GPT-2's linear layer: ``addmm`` on a flattened input (exports as Gemm)."""

        def __init__(self, nx: int, nf: int):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
            self.bias = nn.Parameter(torch.randn(nf) * 0.02)

        def forward(self, x):
            shape = x.shape[:-1] + (self.weight.shape[1],)
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)

    def gelu_new(x):
        """GPT-2's tanh approximation of GELU, as HF's NewGELUActivation writes it."""
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))

    class BertLayer(nn.Module):
        """Post-LN encoder layer with erf GELU."""

        def __init__(self, hidden: int, heads: int):
            super().__init__()
            self.attn = SelfAttention(hidden, heads)
            self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x, bias):
            x = self.ln1(x + self.attn(x, bias))
            return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))

    class Bert(nn.Module):
        """BERT-like encoder: token + position embeddings, 4 layers, hidden 256, 4 heads."""

        def __init__(self, vocab=1000, hidden=256, heads=4, layers=4, max_pos=128):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_pos, hidden)
            self.ln = nn.LayerNorm(hidden, eps=1e-12)
            self.layers = nn.ModuleList(BertLayer(hidden, heads) for _ in range(layers))
            self.pooler = nn.Linear(hidden, hidden)

        def forward(self, input_ids, attention_mask):
            pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
            x = self.ln(self.tok(input_ids) + self.pos(pos))
            bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
            for layer in self.layers:
                x = layer(x, bias)
            return x, torch.tanh(self.pooler(x[:, 0]))

    class Gpt2Block(nn.Module):
        """Pre-LN decoder block with fused QKV (Conv1D) and gelu_new."""

        def __init__(self, hidden: int, heads: int):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.attn = SelfAttention(hidden, heads, fused_qkv=True)
            self.fc, self.proj = Conv1D(hidden, 4 * hidden), Conv1D(4 * hidden, hidden)

        def forward(self, x, bias):
            x = x + self.attn(self.ln1(x), bias)
            return x + self.proj(gelu_new(self.fc(self.ln2(x))))

    class Gpt2(nn.Module):
        """GPT-2-like decoder: causal mask from a buffer, 4 pre-LN blocks, tied LM head."""

        def __init__(self, vocab=1000, hidden=256, heads=4, layers=4, max_pos=128):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(max_pos, hidden)
            self.blocks = nn.ModuleList(Gpt2Block(hidden, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            causal = torch.tril(torch.ones(max_pos, max_pos, dtype=torch.bool))
            self.register_buffer("causal", causal.view(1, 1, max_pos, max_pos), persistent=False)

        def forward(self, input_ids):
            s = input_ids.shape[1]
            x = self.wte(input_ids) + self.wpe(torch.arange(s).unsqueeze(0))
            # Python scalars in torch.where make the TorchScript exporter compute in double
            # and emit an invalid model; HF uses typed tensors, so do we.
            bias = torch.zeros(1, 1, s, s, dtype=x.dtype).masked_fill(
                ~self.causal[:, :, :s, :s], torch.finfo(x.dtype).min)
            for block in self.blocks:
                x = block(x, bias)
            return torch.matmul(self.ln_f(x), self.wte.weight.t())

    def conv_bn(cin, cout, k=1, stride=1, groups=1, act=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection, residual."""

        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            mid = cin * expand
            layers = [conv_bn(cin, mid)] if expand != 1 else []
            layers += [conv_bn(mid, mid, 3, stride, groups=mid), conv_bn(mid, cout, act=False)]
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    class MobileNetV2(nn.Module):
        """MobileNetV2 at width 0.5: BatchNorm, ReLU6 and depthwise convs."""

        CONFIG = ((1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 3, 2), (6, 32, 4, 2), (6, 48, 3, 1),
                  (6, 80, 3, 2), (6, 160, 1, 1))

        def __init__(self, classes=100):
            super().__init__()
            layers, cin = [conv_bn(3, 16, 3, 2)], 16
            for t, c, n, s in self.CONFIG:
                for i in range(n):
                    layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            layers.append(conv_bn(cin, 640))
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(640, classes))

        def forward(self, x):
            x = F.adaptive_avg_pool2d(self.features(x), 1)
            return self.classifier(torch.flatten(x, 1))

    class VitBlock(nn.Module):
        """Pre-LN ViT block; attention through scaled_dot_product_attention (as timm does)."""

        def __init__(self, hidden: int, heads: int):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-6), nn.LayerNorm(hidden, eps=1e-6)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                     nn.Linear(4 * hidden, hidden))

        def forward(self, x):
            b, n, c = x.shape
            qkv = self.qkv(self.ln1(x)).reshape(b, n, 3, self.heads, c // self.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
            x = x + self.proj(a)
            return x + self.mlp(self.ln2(x))

    class Vit(nn.Module):
        """ViT: 8x8 patch conv on a 64x64 image, cls token, 4 blocks, hidden 192, 3 heads."""

        def __init__(self, image=64, patch=8, hidden=192, heads=3, layers=4, classes=100):
            super().__init__()
            self.patch = nn.Conv2d(3, hidden, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, hidden) * 0.02)
            self.blocks = nn.Sequential(*(VitBlock(hidden, heads) for _ in range(layers)))
            self.ln, self.head = nn.LayerNorm(hidden, eps=1e-6), nn.Linear(hidden, classes)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            return self.head(self.ln(self.blocks(x))[:, 0])

    class RmsNorm(nn.Module):
        """LLaMA's RMSNorm, computed in float32 as HF writes it."""

        def __init__(self, hidden: int, eps: float = 1e-6):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

        def forward(self, x):
            var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + self.eps)).to(x.dtype)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    class LlamaBlock(nn.Module):
        """LLaMA decoder layer: RMSNorm, rotary q/k, causal SDPA, SiLU-gated MLP."""

        def __init__(self, hidden: int, heads: int, inter: int):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.norm1, self.norm2 = RmsNorm(hidden), RmsNorm(hidden)
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False)
                                              for _ in range(4))
            self.gate, self.up = (nn.Linear(hidden, inter, bias=False) for _ in range(2))
            self.down = nn.Linear(inter, hidden, bias=False)

        def forward(self, x, cos, sin):
            b, s, c = x.shape
            h = self.norm1(x)
            q, k, v = (p(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                       for p in (self.q, self.k, self.v))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, c))
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        """Small LLaMA: 2 decoder layers, hidden 256, 4 heads, rotary embeddings."""

        def __init__(self, vocab=1000, hidden=256, heads=4, layers=2, inter=688, max_pos=128):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(LlamaBlock(hidden, heads, inter) for _ in range(layers))
            self.norm, self.lm_head = RmsNorm(hidden), nn.Linear(hidden, vocab, bias=False)
            dim = hidden // heads
            inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

        def forward(self, input_ids):
            s = input_ids.shape[1]
            cos, sin = self.cos[:s][None, None], self.sin[:s][None, None]
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))


def _architectures():
    """(name, module factory, example inputs, input names, output names, int input ranges)."""
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(SEED))
    mask = torch.ones(2, 32, dtype=torch.int64)
    mask[1, 24:] = 0
    image = torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(SEED))
    small = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(SEED))
    vocab = {"input_ids": [0, 1000]}
    return [
        ("bert", Bert, (ids, mask), ["input_ids", "attention_mask"],
         ["last_hidden_state", "pooler_output"], vocab),
        ("gpt2", Gpt2, (ids,), ["input_ids"], ["logits"], vocab),
        ("mobilenetv2", MobileNetV2, (image,), ["pixel_values"], ["logits"], {}),
        ("vit", Vit, (small,), ["pixel_values"], ["logits"], {}),
        ("llama", Llama, (ids,), ["input_ids"], ["logits"], vocab),
    ]


# --------------------------------------------------------------------------- export


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def _export(module, args, path: Path, names, outputs, dynamo: bool) -> None:
    tmp = path.with_suffix(".tmp.onnx")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-missing notices
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(module, args, dynamo=True, input_names=names,
                                        output_names=outputs, verbose=False)
            program.save(str(tmp), external_data=False)
        else:
            torch.onnx.export(module, args, str(tmp), dynamo=False, opset_version=TS_OPSET,
                              input_names=names, output_names=outputs)
    try:
        onnx.checker.check_model(str(tmp), full_check=True)
        ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"the exported model is invalid: {_one_line(e)}") from None
    os.replace(tmp, path)


def _describe(entry: Entry) -> Entry:
    if entry.path and Path(entry.path).exists():
        model = onnx.load(entry.path, load_external_data=False)
        entry.nodes = len(model.graph.node)
        entry.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                           None)
    return entry


def build_torch(force: bool = False, log=print) -> list[Entry]:
    """Export every architecture with both exporters into ``bench/.models/`` (cached)."""
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    previous = {e["name"]: e for e in _read_manifest()}
    entries = []
    for name, factory, args, names, outputs, ranges in _architectures():
        for source, dynamo in (("torchscript", False), ("dynamo", True)):
            tag = f"{name}-{'dynamo' if dynamo else 'ts'}"
            path = MODELS_DIR / f"{tag}.onnx"
            old = previous.get(tag)
            if not force and old and (path.exists() or old.get("error")):
                entries.append(Entry(**old))
                continue
            torch.manual_seed(SEED)
            module = factory().eval()
            start = time.perf_counter()
            entry = Entry(tag, str(path), source, input_ranges=ranges)
            try:
                with torch.no_grad():
                    _export(module, args, path, names, outputs, dynamo)
            except Exception as e:  # noqa: BLE001 - recorded, the corpus goes on
                entry.path, entry.error = None, _one_line(e)
                if os.environ.get("BENCH_DEBUG"):
                    traceback.print_exc()
            entry.seconds = round(time.perf_counter() - start, 2)
            entries.append(_describe(entry))
            log(f"  {tag:20} {entry.error or f'{entry.nodes} nodes, opset {entry.opset}'}")
    return entries


def light_models() -> list[Entry]:
    """The onnx wheel's light models (weights built with ConstantOfShape)."""
    paths = sorted(LIGHT_DIR.glob("*.onnx")) if LIGHT_DIR.is_dir() else []
    return [_describe(Entry(p.stem, str(p), "light")) for p in paths]


def _read_manifest() -> list[dict]:
    try:
        return json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return []


def corpus(force: bool = False, log=print) -> list[Entry]:
    """Every model of the corpus; torch exports are built when missing (or when ``force``)."""
    entries: list[Entry] = []
    if torch is None:
        log(INSTALL_HINT)
    else:
        entries += build_torch(force, log)
        MANIFEST.write_text(json.dumps([asdict(e) for e in entries], indent=1))
    return entries + light_models()


def main() -> None:
    log = print
    log(f"building the corpus into {MODELS_DIR}")
    entries = corpus(force=True, log=log)
    ok = [e for e in entries if e.path]
    failed = [e for e in entries if not e.path]
    log(f"{len(ok)} models ready, {len(failed)} exports failed")
    for e in failed:
        log(f"  {e.name}: {e.error}")


if __name__ == "__main__":
    sys.exit(main())
