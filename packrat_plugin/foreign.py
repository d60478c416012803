"""Archives this project did not build: read them, and time them as TorchServe's worker runs them.

A user's ``.mar`` from ``torch-model-archiver`` names a handler (a stock one
such as ``image_classifier``, or a file inside the archive) and a model file,
and only that handler knows what its requests look like.  So a foreign archive
is timed whole, handler and model together, on request bodies the user gives
(``--sample``), in a process pinned to the point's cores with the point's
thread count: the archive is unpacked, TorchServe's own model loader loads its
handler exactly as a worker does (``ts.model_loader``), and each timed call is
TorchServe's own ``Service.predict`` on one batch of requests.  Nothing of the
user's code is changed or copied.

An archive is this project's own when its ``model-config.yaml`` carries
``handler.spec`` (``archiver/build.py`` writes it); those are profiled
model-only, as before (``profiler.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mimetypes
import multiprocessing as mp
import os
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SAMPLE_HINT = (
    "pass --sample FILE (repeatable, or a folder of files): a request body the archive's handler accepts, "
    "such as a JPEG, a JSON file or a text file"
)


class ArchiveError(ValueError):
    """The file is not a TorchServe archive this command can use (the message says why, in one line)."""


@dataclass(frozen=True)
class ArchiveInfo:
    path: Path
    model_name: str
    handler: str
    serialized_file: str | None
    model_file: str | None
    config: dict[str, Any]  # its model-config.yaml; {} when it has none

    @property
    def ours(self) -> bool:
        """Built by ``packrat archive`` (its handler reads ``handler.spec``), not by the user."""
        handler = self.config.get("handler")
        return isinstance(handler, dict) and "spec" in handler


def read_archive(path: str | Path) -> ArchiveInfo:
    """The manifest and model-config.yaml of a ``.mar``, without unpacking it."""
    path = Path(path)
    if not path.is_file():
        raise ArchiveError(f"no archive at {path}")
    try:
        with zipfile.ZipFile(path) as mar:
            names = set(mar.namelist())
            if "MAR-INF/MANIFEST.json" not in names:
                raise ArchiveError(f"{path} is not a TorchServe archive: it has no MAR-INF/MANIFEST.json")
            manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
            model = manifest.get("model") or {}
            config_file = model.get("configFile")
            config = {}
            if config_file:
                if config_file not in names:
                    raise ArchiveError(f"{path}: its manifest names {config_file}, which the archive lacks")
                config = yaml.safe_load(mar.read(config_file)) or {}
    except zipfile.BadZipFile:
        raise ArchiveError(f"{path} is not a TorchServe archive: not a zip file") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ArchiveError(f"{path}: unreadable manifest or model-config.yaml ({type(exc).__name__})") from None
    if not model.get("handler"):
        raise ArchiveError(f"{path}: its manifest names no handler")
    return ArchiveInfo(
        path=path,
        model_name=str(model.get("modelName") or path.stem),
        handler=str(model["handler"]),
        serialized_file=model.get("serializedFile"),
        model_file=model.get("modelFile"),
        config=config if isinstance(config, dict) else {},
    )


@dataclass(frozen=True)
class Sample:
    name: str
    body: bytes
    content_type: str


def read_samples(paths: list[str]) -> list[Sample]:
    """Each ``--sample``: a file, or every visible file of a folder (sorted)."""
    if not paths:
        raise ValueError(SAMPLE_HINT)
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            if not found:
                raise ValueError(f"--sample {path}: the folder has no files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--sample {path}: no such file or folder")
    samples = []
    for path in files:
        body = path.read_bytes()
        if not body:
            raise ValueError(f"--sample {path}: the file is empty")
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        samples.append(Sample(path.name, body, kind))
    return samples


@dataclass(frozen=True)
class ForeignJob:
    archive: str
    model_name: str
    handler: str
    samples: tuple[Sample, ...]
    threads: int
    batch: int
    cores: tuple[int, ...]
    warmup: int = 2


def predict_frames(samples: tuple[Sample, ...], batch: int) -> list[dict[str, Any]]:
    """One batch of requests as TorchServe's frontend hands them to ``Service.predict`` (samples in turn)."""
    frames = []
    for i in range(batch):
        sample = samples[i % len(samples)]
        parameter = {"name": "body", "contentType": sample.content_type, "value": sample.body}
        frames.append({"requestId": f"profile-{i}".encode(), "parameters": [parameter]})
    return frames


class _Errors(logging.Handler):
    """TorchServe's ``Service.predict`` logs a handler's failure (a warning or an error on ``ts.service``)
    and answers 5xx; this keeps the first message."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.first is None:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            self.first = text.splitlines()[0][:300]


def _child(job: ForeignJob, model_dir: str, conn: Any) -> None:
    """Pinned before torch is imported, so its thread pool inherits the cores; then as a worker loads
    (the archive unpacked into ``model_dir``, which the parent owns and removes)."""
    os.sched_setaffinity(0, job.cores)
    os.environ["OMP_NUM_THREADS"] = str(job.threads)
    try:
        import torch

        torch.set_num_threads(job.threads)
        import ts
        from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
        from ts.model_loader import ModelLoaderFactory

        with zipfile.ZipFile(job.archive) as mar:
            mar.extractall(model_dir)
        sys.path.append(model_dir)  # as TorchServe's worker does: a handler file in the archive imports by name
        metrics = MetricsCacheYamlImpl(str(Path(ts.__file__).parent / "configs" / "metrics.yaml"))
        metrics.initialize_cache()
        errors = _Errors()
        logging.getLogger("ts.service").addHandler(errors)
        service = ModelLoaderFactory.get_model_loader().load(
            job.model_name, model_dir, job.handler, None, job.batch, metrics_cache=metrics
        )
        service.set_cl_socket(None)
        frames = predict_frames(job.samples, job.batch)

        def timed() -> float:
            started = time.perf_counter()
            service.predict(frames)
            elapsed = time.perf_counter() - started
            if errors.first is not None:
                raise RuntimeError(f"the archive's handler failed on the samples: {errors.first}")
            refused = [(rp.get_response_status_code(), i) for i, rp in enumerate(service.context.request_processor)]
            refused = [(code, i) for code, i in refused if code >= 400]
            if refused:
                code, i = refused[0]
                name = job.samples[i % len(job.samples)].name
                raise RuntimeError(f"the archive's handler answered {code} to sample {name}")
            return 1e3 * elapsed

        for _ in range(job.warmup):
            timed()
        conn.send(("ready", {"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}))
        while (command := conn.recv()) is not None:
            iters, max_seconds = command
            latencies = [timed()]
            deadline = time.monotonic() + max_seconds
            while len(latencies) < iters and (len(latencies) < 3 or time.monotonic() < deadline):
                latencies.append(timed())
            conn.send(("ok", latencies))
    except Exception as exc:  # reported by the parent as one line
        conn.send(("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))


class ForeignProcess:
    """One pinned process serving the archive's handler for one (threads, batch) point."""

    def __init__(self, job: ForeignJob) -> None:
        ctx = mp.get_context("spawn")
        # The unpacked archive (a model's weights: hundreds of MB for a large
        # one) is removed by this side, whether the child exits or is killed.
        self._model_dir = tempfile.TemporaryDirectory(prefix="packrat-foreign-")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_child, args=(job, self._model_dir.name, child), daemon=True)
        self.process.start()
        child.close()
        try:
            self.seen = self._receive(600.0)
        except BaseException:
            self.close()
            raise

    def _receive(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"the archive's handler did not answer within {timeout_s:g} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError("the archive's handler process died (see its output above)") from None
        if kind == "error":
            raise RuntimeError(value)
        return value

    def time(self, iters: int, max_seconds: float) -> list[float]:
        self.conn.send((iters, max_seconds))
        return self._receive(3600.0)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the process is gone already
            self.conn.send(None)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._model_dir.cleanup()

    def __enter__(self) -> ForeignProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
