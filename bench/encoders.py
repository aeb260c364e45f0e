"""Encoders and vision transformers exported with dynamic axes, as optimum writes them.

Run ``python bench/encoders.py [--out DIR] [--models bert vit]`` (needs torch 2.13.0 and
``transformers``; no weights are downloaded: each model is built from a small config with
random weights from a fixed seed): BERT-style encoders (also ModernBERT, ConvBERT, LayoutLM,
SqueezeBERT, RoFormer, XLNet), decoder stacks read without a cache (also Granite, SmolLM3,
LFM2, GPT-BigCode, Phi, MPT, Starcoder2, OLMo, Qwen3), ViTs (also LeViT, Swin V2),
convolutional networks (ResNet, MobileNetV2, EfficientNet, RegNet, ConvNeXt V2, PoolFormer),
DETR and speech encoders (also WavLM, SEW). Each architecture is exported by the TorchScript
exporter (opset 17) with optimum's dim names (``batch_size``, ``sequence_length``; images have a
dynamic batch only), as ``NAME.dyn.onnx``, and by the dynamo exporter with fixed shapes, as
``NAME.dynamo.onnx``; ``--half`` exports them in float16 instead, as ``NAME.dyn.fp16.onnx``
and ``NAME.dynamo.fp16.onnx``. Text models (and decoder stacks read without a cache: Gemma,
Phi-3, GPT-J, CodeGen, Cohere, Falcon...) read ``input_ids`` and ``attention_mask`` [2, 16];
vision models ``pixel_values`` [2, 3, 64, 64]; speech models ``input_values`` [2, 1600] (wav2vec2,
HuBERT) or Whisper's encoder ``input_features`` [2, 80, 64]. Attention is torch's sdpa where
the architecture has it, else its eager code.

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
AUDIO = dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256,
             conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)

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
    # decoder stacks read as encoders (no cache): their norms, rotaries and attentions
    "gemma": ("GemmaConfig", "GemmaModel",
              dict(TEXT, num_key_value_heads=1, head_dim=32), "text"),
    "gemma2": ("Gemma2Config", "Gemma2Model",
               dict(TEXT, num_key_value_heads=2, head_dim=32, sliding_window=8), "text"),
    "phi3": ("Phi3Config", "Phi3Model", dict(TEXT, num_key_value_heads=4, pad_token_id=0),
             "text"),
    "gptj": ("GPTJConfig", "GPTJModel", dict(n_embd=128, n_head=4, n_layer=2, rotary_dim=16,
                                             vocab_size=512, n_positions=128), "text"),
    # interleaved rotary: GPT-J's [B, S, H, D] heads (CodeGen), Cohere's [B, H, S, D] ones
    "codegen": ("CodeGenConfig", "CodeGenModel", dict(n_embd=128, n_head=4, n_layer=2,
                                                      rotary_dim=16, vocab_size=512,
                                                      n_positions=128, n_ctx=128), "text"),
    "cohere": ("CohereConfig", "CohereModel", dict(TEXT, num_key_value_heads=2, pad_token_id=0),
               "text"),
    "opt": ("OPTConfig", "OPTModel", dict(hidden_size=128, num_attention_heads=4,
                                          num_hidden_layers=2, ffn_dim=256, vocab_size=512,
                                          max_position_embeddings=128, word_embed_proj_dim=128),
            "text"),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoModel", dict(hidden_size=128, num_heads=4, num_layers=2,
                                                    attention_types=[[["global", "local"], 1]],
                                                    window_size=8, vocab_size=512,
                                                    max_position_embeddings=128), "text"),
    "esm": ("EsmConfig", "EsmModel", dict(TEXT, position_embedding_type="rotary",
                                          pad_token_id=1, mask_token_id=2), "text"),
    "persimmon": ("PersimmonConfig", "PersimmonModel", dict(TEXT, partial_rotary_factor=0.5),
                  "text"),
    "falcon": ("FalconConfig", "FalconModel", dict(hidden_size=128, num_attention_heads=4,
                                                   num_hidden_layers=2, vocab_size=512), "text"),
    "stablelm": ("StableLmConfig", "StableLmModel", dict(TEXT, num_key_value_heads=4), "text"),
    "mobilebert": ("MobileBertConfig", "MobileBertModel",
                   dict(TEXT, embedding_size=64, intra_bottleneck_size=64, true_hidden_size=64,
                        num_feedforward_networks=2), "text"),
    "bart-encoder": ("BartConfig", "BartModel",
                     dict(d_model=128, encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_layers=2, decoder_layers=2, encoder_ffn_dim=256,
                          decoder_ffn_dim=256, vocab_size=512, max_position_embeddings=128),
                     "encoder"),
    "convnext": ("ConvNextConfig", "ConvNextModel",
                 dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=64),
                 "vision"),
    "segformer": ("SegformerConfig", "SegformerModel",
                  dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                       num_attention_heads=[1, 2, 4, 8], decoder_hidden_size=64), "vision"),
    "beit": ("BeitConfig", "BeitModel", dict(VISION, use_relative_position_bias=True),
             "vision"),
    "dinov2": ("Dinov2Config", "Dinov2Model", VISION, "vision"),
    "mobilevit": ("MobileViTConfig", "MobileViTModel",
                  dict(image_size=64, hidden_sizes=[32, 48, 64],
                       neck_hidden_sizes=[8, 16, 24, 24, 32, 40, 64]), "vision"),
    "yolos": ("YolosConfig", "YolosModel", dict(VISION, image_size=[64, 64],
                                                num_detection_tokens=10), "vision"),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", dict(AUDIO, feat_extract_norm="group"),
                 "audio"),
    "hubert": ("HubertConfig", "HubertModel",
               dict(AUDIO, do_stable_layer_norm=True, feat_extract_norm="layer"), "audio"),
    # 2025-era text encoders and decoder stacks: local/global attention with GeGLU
    # (ModernBERT), scaled residuals (Granite), layers without rotary (SmolLM3), a short
    # convolution in place of some attentions (LFM2)
    "modernbert": ("ModernBertConfig", "ModernBertModel",
                   dict(TEXT, global_attn_every_n_layers=2, local_attention=8,
                        pad_token_id=0), "text"),
    "granite": ("GraniteConfig", "GraniteModel",
                dict(TEXT, num_key_value_heads=2, residual_multiplier=0.5,
                     embedding_multiplier=2.0, attention_multiplier=0.1), "text"),
    "smollm3": ("SmolLM3Config", "SmolLM3Model",
                dict(TEXT, num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0),
                "text"),
    "lfm2": ("Lfm2Config", "Lfm2Model",
             dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, intermediate_size=256, vocab_size=512,
                  layer_types=["conv", "full_attention"], pad_token_id=0), "text"),
    "convbert": ("ConvBertConfig", "ConvBertModel", dict(TEXT, embedding_size=128), "text"),
    "layoutlm": ("LayoutLMConfig", "LayoutLMModel", TEXT, "text"),
    # convolutional and detection vision models as transformers writes them
    "resnet": ("ResNetConfig", "ResNetModel",
               dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                    layer_type="bottleneck"), "vision"),
    "mobilenet-v2": ("MobileNetV2Config", "MobileNetV2Model",
                     dict(image_size=64, depth_multiplier=0.35), "vision"),
    "efficientnet": ("EfficientNetConfig", "EfficientNetModel",
                     dict(image_size=64, width_coefficient=0.25, depth_coefficient=0.25,
                          hidden_dim=320), "vision"),
    "siglip-vision": ("SiglipVisionConfig", "SiglipVisionModel", VISION, "vision"),
    "detr": ("DetrConfig", "DetrModel",
             dict(use_timm_backbone=False, use_pretrained_backbone=False,
                  backbone_config=dict(model_type="resnet", embedding_size=16,
                                       hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                       out_features=["stage4"]),
                  d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                  num_queries=10), "vision"),
    # more attention forms: convolutional projections (SqueezeBERT), rotary in BERT
    # (RoFormer), relative attention (XLNet), multi-query (GPT-BigCode), partial rotary
    # (Phi), ALiBi (MPT), sliding window (Starcoder2), q/k norms (Qwen3), attention biases
    # by position (LeViT), cosine attention (Swin V2), gated relative positions (WavLM)
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertModel", dict(TEXT, embedding_size=128),
                    "text"),
    "roformer": ("RoFormerConfig", "RoFormerModel", dict(TEXT, embedding_size=128), "text"),
    "big-bird": ("BigBirdConfig", "BigBirdModel", dict(TEXT, attention_type="original_full"),
                 "text"),
    "rembert": ("RemBertConfig", "RemBertModel",
                dict(hidden_size=128, num_attention_heads=4, num_hidden_layers=2,
                     intermediate_size=256, vocab_size=512, input_embedding_size=64,
                     output_embedding_size=64), "text"),
    "xlnet": ("XLNetConfig", "XLNetModel",
              dict(d_model=128, n_head=4, n_layer=2, d_inner=256, vocab_size=512), "text"),
    "gpt-bigcode": ("GPTBigCodeConfig", "GPTBigCodeModel",
                    dict(n_embd=128, n_head=4, n_layer=2, vocab_size=512, n_positions=128,
                         multi_query=True), "text"),
    "phi": ("PhiConfig", "PhiModel", dict(TEXT, partial_rotary_factor=0.5, pad_token_id=0),
            "text"),
    "mpt": ("MptConfig", "MptModel",
            dict(d_model=128, n_heads=4, n_layers=2, vocab_size=512, max_seq_len=128), "text"),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model",
                   dict(TEXT, num_key_value_heads=2, pad_token_id=0), "text"),
    "olmo": ("OlmoConfig", "OlmoModel", dict(TEXT, pad_token_id=0), "text"),
    "qwen3": ("Qwen3Config", "Qwen3Model",
              dict(TEXT, num_key_value_heads=2, head_dim=32, pad_token_id=0), "text"),
    "levit": ("LevitConfig", "LevitModel",
              dict(image_size=64, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4],
                   depths=[1, 1, 1], key_dim=[16, 16, 16]), "vision"),
    "poolformer": ("PoolFormerConfig", "PoolFormerModel",
                   dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]), "vision"),
    "regnet": ("RegNetConfig", "RegNetModel",
               dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                    groups_width=8), "vision"),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2Model",
                   dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], image_size=64),
                   "vision"),
    "swinv2": ("Swinv2Config", "Swinv2Model",
               dict(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
                    window_size=4), "vision"),
    "wavlm": ("WavLMConfig", "WavLMModel", dict(AUDIO, feat_extract_norm="group"), "audio"),
    "sew": ("SEWConfig", "SEWModel", dict(AUDIO, squeeze_factor=2), "audio"),
    "whisper-encoder": ("WhisperConfig", "WhisperModel",
                        dict(d_model=128, encoder_attention_heads=4, decoder_attention_heads=4,
                             encoder_layers=2, decoder_layers=2, encoder_ffn_dim=256,
                             decoder_ffn_dim=256, vocab_size=512, num_mel_bins=80,
                             max_source_positions=32, max_target_positions=64, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                        "features"),
}


def _model(name: str):
    import torch
    import transformers

    config_class, model_class, kwargs, kind = CONFIGS[name]
    config = getattr(transformers, config_class)(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    try:
        return getattr(transformers, model_class)(config).eval(), kind
    except ValueError:  # no sdpa attention in this architecture (GPT-J, Gemma 2...)
        config._attn_implementation = "eager"
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
            if kind == "audio":
                return self.model(args[0])[0]
            if kind == "features":
                return self.model.encoder(args[0])[0]
            if kind == "encoder":
                return self.model.get_encoder()(input_ids=args[0], attention_mask=args[1])[0]
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
    elif kind == "audio":
        signal = torch.randn(2, 1600, generator=generator)
        args = (signal.half() if half else signal,)
        names = ["input_values"]
        axes = {"input_values": {0: "batch_size", 1: "sequence_length"},
                "output": {0: "batch_size", 1: "frames"}}
    elif kind == "features":
        # Whisper's encoder takes exactly 2 * max_source_positions frames: a dynamic batch
        features = torch.randn(2, 80, 64, generator=generator)
        args = (features.half() if half else features,)
        names = ["input_features"]
        axes = {"input_features": {0: "batch_size"}, "output": {0: "batch_size"}}
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
