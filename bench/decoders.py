"""Decoder exports with a KV cache, as optimum and transformers users make them.

Run ``python bench/decoders.py [--out DIR] [--models gpt2 llama] [--dynamic]`` (needs torch
2.13.0 and ``transformers``; no weights are downloaded: each model is built from a small
config with random weights from a fixed seed). Each architecture is exported with both torch
exporters in three steps, named ``NAME.EXPORTER.pPAST.sSEQ.onnx``:

* ``p0.s6``: the first step, no past, the present returned (``use_cache=True``);
* ``p8.s1``: a decode step, eight cached tokens and one new one;
* ``p8.s4``: a chunked prefill, eight cached tokens and four new ones.

``--half`` exports the model in float16 (weights, cache and computation), as deployments on
GPUs ship them; the files are then named ``NAME.EXPORTER.TAG.fp16.onnx``.

``--dynamic`` exports one more model per architecture, ``NAME.ts.dyn.onnx``, with batch,
sequence and past length as symbolic dims and optimum's names (``past_sequence_length +
sequence_length`` for the mask and the present). TorchScript only: torch.export's derived
dims are of one symbol, so a dynamo export declares the mask's length as a symbol unrelated
to past + sequence, and no generated input can run it. The inputs are
``input_ids``, ``attention_mask`` (over past + new tokens) and ``past_key_values.N.key/value``;
the outputs ``logits`` and ``present.N.key/value``.

The corpus is for sweeps by hand (``bench/sweep.py``), not the benchmark: transformers is not
one of fusectl's dependencies. A failed export prints its reason and the script goes on.
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
from pathlib import Path

import hf_corpus

SEED = 0
LAYERS = 2
STEPS = ((0, 6), (8, 1), (8, 4))

CONFIGS = {
    # name: (transformers config class, its arguments)
    "gpt2": ("GPT2Config", dict(n_embd=128, n_head=4, n_layer=LAYERS, vocab_size=512,
                                n_positions=128)),
    "opt": ("OPTConfig", dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=LAYERS,
                              ffn_dim=256, vocab_size=512, max_position_embeddings=128,
                              word_embed_proj_dim=128)),
    "llama": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=LAYERS, intermediate_size=256,
                                  vocab_size=512, max_position_embeddings=128)),
    "qwen2": ("Qwen2Config", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=LAYERS, intermediate_size=256,
                                  vocab_size=512, max_position_embeddings=128)),
    "phi": ("PhiConfig", dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=LAYERS,
                              intermediate_size=256, vocab_size=512,
                              max_position_embeddings=128)),
    "mistral": ("MistralConfig", dict(hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=LAYERS,
                                      intermediate_size=256, vocab_size=512,
                                      max_position_embeddings=128)),
}


def _model(name: str):
    import torch
    import transformers

    class_name, kwargs = CONFIGS[name]
    config = getattr(transformers, class_name)(**kwargs)
    config._attn_implementation = "eager" if name == "gpt2" else "sdpa"
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config).eval(), config


def _with_cache(model, layers: int):
    """A module taking the cache as flat tensors (what both exporters can trace) and
    returning the logits and the present as flat tensors."""
    import torch
    from transformers import DynamicCache

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(config=model.config)
            for layer in range(len(past) // 2):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             past_key_values=cache, use_cache=True)
            present = out.past_key_values
            flat = []
            for layer in range(layers):
                flat += [present.layers[layer].keys, present.layers[layer].values]
            return (out.logits, *flat)

    return Wrapper().eval()


def _inputs(config, past: int, seq: int, batch: int = 2, half: bool = False):
    import torch

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = config.hidden_size // heads
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    cache = []
    for _ in range(LAYERS if past else 0):
        cache += [torch.randn(batch, kv_heads, past, head_dim, generator=generator)
                  for _ in range(2)]
    if half:
        cache = [c.half() for c in cache]
    return (ids, mask, *cache)


def _names(past: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "attention_mask"]
    for layer in range(LAYERS if past else 0):
        inputs += [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
    outputs = ["logits"]
    for layer in range(LAYERS):
        outputs += [f"present.{layer}.key", f"present.{layer}.value"]
    return inputs, outputs


def _export(module, args, path: Path, names: list[str], outputs: list[str], dynamo: bool,
            dynamic: bool) -> None:
    import torch

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    kwargs = {}
    if dynamic:
        # optimum's names: a dim spelled as a sum is the past and the new tokens
        batch, seq, past = "batch_size", "sequence_length", "past_sequence_length"
        total = f"{past} + {seq}"
        axes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total},
                "logits": {0: batch, 1: seq}}
        for name in names[2:]:
            axes[name] = {0: batch, 2: past}
        for name in outputs[1:]:
            axes[name] = {0: batch, 2: total}
        kwargs["dynamic_axes"] = axes
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(module, args, dynamo=True, input_names=names,
                                        output_names=outputs, verbose=False, **kwargs)
            program.save(str(path), external_data=False)
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17,
                              input_names=names, output_names=outputs, **kwargs)


def build(out: Path, models: list[str], dynamic: bool, debug: bool = False,
          half: bool = False) -> int:
    """Export every requested model; returns how many exports failed."""
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    suffix = ".fp16" if half else ""
    for name in models:
        model, config = _model(name)
        if half:
            model = model.half()
        steps = [(p, s, f"p{p}.s{s}") for p, s in STEPS]
        if dynamic:
            steps.append((8, 4, "dyn"))
        for past, seq, tag in steps:
            module = _with_cache(model, LAYERS)
            args = _inputs(config, past, seq, half=half)
            names, outputs = _names(past)
            for exporter, dynamo in (("ts", False), ("dynamo", True)):
                if dynamo and tag == "dyn":
                    continue  # see the module docstring
                path = out / f"{name}.{exporter}.{tag}{suffix}.onnx"
                try:
                    _export(module, args, path, names, outputs, dynamo, tag == "dyn")
                    print(f"  {path.name}")
                except Exception as e:  # noqa: BLE001 - reported, the corpus goes on
                    failed += 1
                    path.unlink(missing_ok=True)
                    line = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                    print(f"  {path.name}: FAILED {line}")
                    if debug:
                        traceback.print_exc()
    return failed


def main() -> int:
    parser = hf_corpus.parser(__doc__, "decoders", sorted(CONFIGS))
    parser.add_argument("--dynamic", action="store_true",
                        help="also export with symbolic batch, sequence and past length")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args()
    if hf_corpus.missing():
        return 2
    failed = build(args.out, args.models, args.dynamic, args.debug, args.half)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
