"""Where an image request should be decoded on a GPU server: PIL on threads, torchvision on threads, or nvJPEG.

    python -m bench.jpeg_decode                  # CPU ways only (this machine)
    python -m bench.jpeg_decode --device cuda    # adds torchvision's batched GPU decode (nvJPEG)

Ebird's capacity on a GPU is bounded by its per-request host path: decoding
ResNet-50's JPEGs on 4 threads cost 553 ms of queueing per request at 85 %
of NO Wait's capacity on the H200 (docs/benchmarks/reading/gpu.md).  Before
building a decode path, this measures what each candidate delivers on the
machine, the same ImageNet evaluation pipeline each time (short side to 256,
centre crop 224, scale, normalise), on the sample JPEGs the benchmarks send:

- ``pil``: the codec's own decode (``handlers.codecs.InputCodec``: PIL, then
  torchvision's PIL transforms), what every handler runs today, on k threads;
- ``tv-cpu``: ``torchvision.io.decode_jpeg`` to a uint8 tensor, then the same
  steps as tensor ops (``InputCodec.image_from_pixels``, what the batched
  decoder runs: antialiased bilinear resize), on k threads;
- ``tv-cuda``: ``decode_jpeg(list, device="cuda")``, nvJPEG decoding a batch
  of b images in one call, resized, cropped and normalised on the GPU, one
  host thread (the answer lands on the device, where the model wants it).

``--contend`` runs eager ResNet-50 at batch 8 on the device in a thread
beside the decoding, as Ebird's engine threads run beside its decoders, and
reports the model's batches/s during each way too: a decoder that holds the
GIL slows the launcher that keeps the GPU busy.

Each way decodes the same ``--images`` JPEGs; a round times every way once,
in an order reversed every other round; the table gives the median images/s
over ``--repeats`` rounds with the min-max, and each tensor way's largest
difference from ``pil``'s output (the resamplers differ slightly).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import add_output_arguments, markdown_table, provenance, provenance_block, write_outputs


def _ways(device: str, threads: list[int], batches: list[int]) -> dict[str, Any]:
    """name -> function(list of JPEG bytes) -> list of decoded tensors (the name says how)."""
    import torch
    from torchvision.io import decode_jpeg

    from handlers.codecs import InputCodec
    from model_store.catalog import load_catalog

    codec = InputCodec(load_catalog()["resnet50"])

    def pil_one(raw: bytes):
        return codec.decode({"body": raw}).tensors[0]

    def tv_one(raw: bytes):
        return codec.image_from_pixels(decode_jpeg(torch.frombuffer(bytearray(raw), dtype=torch.uint8)))

    ways: dict[str, Any] = {}
    for k in threads:
        pool = ThreadPoolExecutor(k, initializer=torch.set_num_threads, initargs=(1,))
        ways[f"pil x{k}"] = lambda raws, pool=pool: list(pool.map(pil_one, raws))
        ways[f"tv-cpu x{k}"] = lambda raws, pool=pool: list(pool.map(tv_one, raws))
    if device == "cuda":

        def gpu(raws: list[bytes], b: int):
            out = []
            for start in range(0, len(raws), b):
                chunk = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raws[start : start + b]]
                out.extend(codec.image_from_pixels(img) for img in decode_jpeg(chunk, device="cuda"))
            torch.cuda.synchronize()
            return out

        for b in batches:
            ways[f"tv-cuda b{b}"] = lambda raws, b=b: gpu(raws, b)
    return ways


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from model_store.samples import jpeg_bytes

    raws = [jpeg_bytes(seed, size=(280, 280)) for seed in range(args.images)]
    ways = _ways(args.device, [int(k) for k in args.threads.split(",")], [int(b) for b in args.batches.split(",")])
    reference = ways["pil x1"](raws[:8])
    diffs = {}
    for name, fn in ways.items():  # warm every way once (nvJPEG's handles, pools' threads)
        got = fn(raws[:8])
        diffs[name] = max(float((g.cpu() - r).abs().max()) for g, r in zip(got, reference, strict=True))
    rates: dict[str, list[float]] = {name: [] for name in ways}
    beside: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    with _Contender(args.device, args.contend) as contender:
        for rnd in tqdm(range(args.repeats), desc="rounds"):
            for name in names if rnd % 2 == 0 else names[::-1]:
                batches_before, started = contender.batches, time.perf_counter()
                ways[name](raws)
                elapsed = time.perf_counter() - started
                rates[name].append(len(raws) / elapsed)
                beside[name].append((contender.batches - batches_before) / elapsed)
    rows = [
        {
            "way": name,
            "images_per_s": statistics.median(r),
            "min": min(r),
            "max": max(r),
            "max_abs_diff_vs_pil": diffs[name],
            "model_batches_per_s": statistics.median(beside[name]) if args.contend else None,
        }
        for name, r in rates.items()
    ]
    return {
        "device": args.device,
        "images": args.images,
        "contend": args.contend,
        "alone_batches_per_s": contender.alone_rate,
        "torch": torch.__version__,
        "rows": rows,
    }


class _Contender:
    """Eager ResNet-50 at batch 8 in a loop on its own thread (``enabled``), counting finished batches."""

    def __init__(self, device: str, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        self.batches = 0
        self.alone_rate: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Contender:
        if self.enabled:
            import torch
            from torchvision.models import resnet50

            self._model = resnet50().eval().to(self.device)
            self._x = torch.randn(8, 3, 224, 224, device=self.device)
            with torch.inference_mode():
                for _ in range(2):
                    self._forward()
                started, n = time.perf_counter(), 0
                while time.perf_counter() - started < 1.0:
                    self._forward()
                    n += 1
            self.alone_rate = n / (time.perf_counter() - started)
            self._thread.start()
        return self

    def _forward(self) -> None:
        import torch

        self._model(self._x)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while not self._stop.is_set():
                self._forward()
                self.batches += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()


def render(data: dict[str, Any]) -> str:
    header = ["way", "images/s (median)", "min-max", "max |diff| vs pil"]
    rows = [
        [r["way"], f"{r['images_per_s']:.0f}", f"{r['min']:.0f}-{r['max']:.0f}", f"{r['max_abs_diff_vs_pil']:.3g}"]
        for r in data["rows"]
    ]
    note = ""
    if data.get("contend"):
        header.append("ResNet-50 b8 batches/s beside it")
        for row, r in zip(rows, data["rows"], strict=True):
            row.append(f"{r['model_batches_per_s']:.1f}")
        note = f"ResNet-50 at batch 8 alone on the device: {data['alone_batches_per_s']:.1f} batches/s.\n\n"
    return (
        f"# JPEG decode to ResNet-50's input ({data['device']}, {data['images']} images of 280x280, "
        f"torch {data['torch']})\n\n"
        + markdown_table(header, rows)
        + "\n\n"
        + note
        + provenance_block(data["provenance"])
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--threads", default="1,4,8", help="decode threads for the CPU ways")
    parser.add_argument("--batches", default="1,8,32", help="images per nvJPEG call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contend", action="store_true", help="eager ResNet-50 running beside the decoders")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    data = measure(args)
    data["provenance"] = provenance("bench.jpeg_decode")
    print(render(data))
    suffix = "_contended" if args.contend else ""
    write_outputs(f"jpeg_decode_{args.device}{suffix}", render(data), data, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
