"""Encoders and vision transformers exported with dynamic axes, as optimum writes them.

Run ``python bench/encoders.py [--out DIR] [--models bert vit]`` (needs torch 2.13.0 and
``transformers``; no weights are downloaded: each model is built from a small config with
random weights from a fixed seed). Each architecture is exported by the TorchScript exporter
(opset 17) with optimum's dim names (``batch_size``, ``sequence_length``; images have a
dynamic batch only), as ``NAME.dyn.onnx``, and by the dynamo exporter with fixed shapes, as
``NAME.dynamo.onnx``; ``--half`` exports them in float16 instead, as ``NAME.dyn.fp16.onnx``
and ``NAME.dynamo.fp16.onnx``. Text models read ``input_ids`` and ``attention_mask`` [2, 16]; vision
models ``pixel_values`` [2, 3, 64, 64].

A sweep corpus for ``bench/sweep.py``, run by hand, never in CI. A failed export prints its
reason and the script goes on.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import hf_corpus

SEED = 0
TEXT = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256,
            vocab_size=512, max_position_embeddings=128)
VISION = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=256, image_size=64, patch_size=8)

CONFIGS = {
    # name: (config class, model class, arguments, kind)
    "bert": ("BertConfig", "BertModel", TEXT, "text"),
    "roberta": ("RobertaConfig", "RobertaModel", dict(TEXT, max_position_embeddings=130),
                "text"),
    "distilbert": ("DistilBertConfig", "DistilBertModel",
                   dict(dim=128, n_heads=4, n_layers=2, hidden_dim=256, vocab_size=512,
                        max_position_embeddings=128), "text"),
    "albert": ("AlbertConfig", "AlbertModel", dict(TEXT, embedding_size=64), "text"),
    "electra": ("ElectraConfig", "ElectraModel", dict(TEXT, embedding_size=128), "text"),
    "deberta-v2": ("DebertaV2Config", "DebertaV2Model", TEXT, "text"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel",
                    dict(TEXT, max_position_embeddings=130), "text"),
    "mpnet": ("MPNetConfig", "MPNetModel", dict(TEXT, max_position_embeddings=130), "text"),
    "t5-encoder": ("T5Config", "T5EncoderModel",
                   dict(d_model=128, num_heads=4, num_layers=2, d_ff=256, d_kv=32,
                        vocab_size=512), "text"),
    "bloom": ("BloomConfig", "BloomModel", dict(hidden_size=128, n_head=4, n_layer=2,
                                                  vocab_size=512), "text"),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXModel", TEXT, "text"),
    "clip-text": ("CLIPTextConfig", "CLIPTextModel", dict(TEXT, max_position_embeddings=64),
                  "text"),
    "vit": ("ViTConfig", "ViTModel", VISION, "vision"),
    "deit": ("DeiTConfig", "DeiTModel", VISION, "vision"),
    "swin": ("SwinConfig", "SwinModel", dict(image_size=64, patch_size=4, embed_dim=32,
                                             depths=[2, 2], num_heads=[2, 4], window_size=4),
             "vision"),
    "clip-vision": ("CLIPVisionConfig", "CLIPVisionModel", VISION, "vision"),
}


def _model(name: str):
    import torch
    import transformers

    config_class, model_class, kwargs, kind = CONFIGS[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(SEED)
    return getattr(transformers, model_class)(config).eval(), kind


def _first_output(model, kind: str):
    """A module returning the model's first output as a plain tensor (both exporters trace
    it)."""
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args):
            if kind == "vision":
                return self.model(pixel_values=args[0])[0]
            return self.model(input_ids=args[0], attention_mask=args[1])[0]

    return Wrapper().eval()


def _export(name: str, out: Path, half: bool = False) -> list[str]:
    import torch

    model, kind = _model(name)
    if half:
        model = model.half()
    module = _first_output(model, kind)
    generator = torch.Generator().manual_seed(SEED)
    suffix = ".fp16" if half else ""
    if kind == "vision":
        pixels = torch.randn(2, 3, 64, 64, generator=generator)
        args = (pixels.half() if half else pixels,)
        names = ["pixel_values"]
        # a dynamic batch only: position embeddings and Swin's windows fix the image size
        axes = {"pixel_values": {0: "batch_size"}, "output": {0: "batch_size"}}
    else:
        args = (torch.randint(0, 512, (2, 16), generator=generator),
                torch.ones(2, 16, dtype=torch.int64))
        names = ["input_ids", "attention_mask"]
        axes = {n: {0: "batch_size", 1: "sequence_length"} for n in names}
        axes["output"] = {0: "batch_size", 1: "sequence_length"}
    written = []
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        path = out / f"{name}.dyn{suffix}.onnx"
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17,
                          input_names=names, output_names=["output"], dynamic_axes=axes)
        written.append(path.name)
        path = out / f"{name}.dynamo{suffix}.onnx"
        program = torch.onnx.export(module, args, dynamo=True, input_names=names,
                                    output_names=["output"], verbose=False)
        program.save(str(path), external_data=False)
        written.append(path.name)
    return written


def main() -> int:
    args = hf_corpus.parser(__doc__, "encoders", sorted(CONFIGS)).parse_args()
    if hf_corpus.missing():
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.models:
        try:
            for written in _export(name, args.out, args.half):
                print(f"  {written}")
        except Exception as e:  # noqa: BLE001 - reported, the corpus goes on
            failed += 1
            print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
