"""``packrat serve``: the controller from the command line (``serve_admin.py`` has ``status`` and ``stop``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import threading
from pathlib import Path

from archiver.names import catalog_name
from packrat_plugin.archives import is_users_archive
from packrat_plugin.calibration import CalibrationConfig
from packrat_plugin.controller import PackratController
from packrat_plugin.division import OBJECTIVES, DivisionConfig
from packrat_plugin.foreign import read_archive
from packrat_plugin.load_monitor import MonitorConfig
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.policy import PolicyConfig
from packrat_plugin.profiler import profile_for_this_machine
from packrat_plugin.serve_admin import DEFAULT_STATUS_PORT, DEFAULT_WORKDIR, format_status
from packrat_plugin.swapper import SwapperConfig
from serving_harness.oip_grpc import OipGrpcFront
from serving_harness.torchserve import REPO_CONFIG, Ports, read_properties


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{what} must be NAME=PATH, got {value!r}")
        out[name] = path
    return out


def _inference_host(config: Path) -> str:
    """The host of the config's inference_address (0.0.0.0 in a container), loopback by default."""
    address = read_properties(config).get("inference_address", "http://127.0.0.1:8080")
    return address.split("://", 1)[-1].rsplit(":", 1)[0] or "127.0.0.1"


def _ports_from(config: Path) -> Ports:
    props = read_properties(config)

    def port(key: str, default: int) -> int:
        return int(props.get(key, f":{default}").rsplit(":", 1)[1])

    return Ports(port("inference_address", 8080), port("management_address", 8081), port("metrics_address", 8082))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", required=True, metavar="NAME=ARCHIVE", help="archives to serve")
    p.add_argument("--profile", nargs="*", default=[], metavar="NAME=PROFILE",
                   help="profile per model (default: profiles/<catalog name>.json)")  # fmt: skip
    p.add_argument("--config", type=Path, default=REPO_CONFIG, help="TorchServe config.properties")
    p.add_argument("--free-ports", action="store_true", help="ignore the config's ports, take free ones")
    p.add_argument("--log-config", type=Path, default=None, metavar="LOG4J2_XML",
                   help="TorchServe's log4j2 file (default: its log files, rolled at 100 MB, never daily)")  # fmt: skip
    p.add_argument("--status-port", type=int, default=DEFAULT_STATUS_PORT)
    p.add_argument("--status-host", default="127.0.0.1",
                   help="address the status and /metrics server binds (0.0.0.0 in a scraped pod)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                   help="where TorchServe's logs, the plan files and the archives' copies go; a TorchServe "
                        "started from here and still running is taken over")  # fmt: skip
    p.add_argument(
        "--fixed-batch", type=int, help="serve the plan for this B (rounded down to a power of two), never change it"
    )
    p.add_argument("--no-reconfigure", action="store_true", help="keep the first plan")
    p.add_argument("--mixed-plans", action="store_true",
                   help="with --fixed-batch: serve the optimizer's exact plan for B, several instance types "
                        "at once (one worker, one pinned lane per instance)")  # fmt: skip
    p.add_argument("--max-batch-delay", type=int, default=5, help="TorchServe max_batch_delay (ms)")
    p.add_argument("--force-profile", action="store_true", help="use profiles measured on other hardware")
    p.add_argument("--oip-grpc-port", type=int, default=None, metavar="PORT",
                   help="also serve the Open Inference Protocol over gRPC (the standard inference."
                        "GRPCInferenceService) on this loopback port; 0 takes a free one")  # fmt: skip
    add_policy_arguments(p)


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """The controller's settings a user may want to change; the rest are ``--tune`` values (``TUNABLE``)."""
    pol, ctl = PolicyConfig(), ControllerConfig()
    g = p.add_argument_group("reconfiguration policy (see docs/packrat.md)")
    g.add_argument("--up-confirm", type=float, default=pol.up_confirm_s, help="a rise must last this long (s)")
    g.add_argument("--down-confirm", type=float, default=pol.down_confirm_s, help="a fall must last this long (s)")
    g.add_argument("--min-gain", type=float, default=pol.min_gain,
                   help="least relative latency gain worth a swap (hysteresis between two plans)")  # fmt: skip
    g.add_argument("--standby-workers", type=int, default=ctl.standby_workers,
                   help="idle workers kept warm for fast swaps (each holds a copy of the model; 0: none)")  # fmt: skip
    g.add_argument(
        "--no-calibrate",
        action="store_true",
        help="plan on the bare profile (the model alone), not on what serving measures (calibration.py)",
    )
    g.add_argument("--tune", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="set any other field of the controller's settings, for experiments: "
                        f"sections {', '.join(TUNABLE)} (their fields and defaults: docs/packrat.md), "
                        "e.g. --tune monitor.period_s=0.5 --tune policy.up_rule=expected")  # fmt: skip
    div = DivisionConfig()
    m = p.add_argument_group("several models on one server (see packrat_plugin/division.py)")
    m.add_argument(
        "--no-share-cores",
        action="store_true",
        help="let every model plan over all cores as if it were alone (they then compete for them)",
    )
    m.add_argument(
        "--share-objective",
        choices=OBJECTIVES,
        default=div.objective,
        help="divide the cores to minimise the worst model's predicted mean latency, or the "
        "load-weighted mean over all models",
    )
    m.add_argument(
        "--min-cores",
        type=int,
        default=div.min_cores,
        help="cores every model keeps however idle, so it never stops answering",
    )
    m.add_argument(
        "--division-min-gain",
        type=float,
        default=div.min_gain,
        help="least relative gain of the objective worth a re-division",
    )
    m.add_argument("--division-confirm", type=float, default=div.confirm_s,
                   help="a better division must stay best this long (s)")  # fmt: skip


def targets_from(args: argparse.Namespace) -> list[ModelTarget]:
    archives = _pairs(args.models, "--models")
    profiles = _pairs(args.profile, "--profile")
    targets = []
    for name, archive in archives.items():
        path = Path(archive)
        if not path.is_file():
            raise ValueError(f"no archive at {path} (build one with torch-model-archiver or `packrat archive`)")
        given = Path(profiles[name]) if name in profiles else None
        if is_users_archive(path):  # profiled whole with the user's samples (`packrat profile X.mar --sample`)
            model = read_archive(path).model_name
            profile, _ = profile_for_this_machine(model, given, args.force_profile, users_archive=path)
        else:
            profile, _ = profile_for_this_machine(catalog_name(path), given, args.force_profile)
        targets.append(ModelTarget(name, path, profile))
    return targets


TUNABLE: dict[str, type] = {
    "policy": PolicyConfig,
    "monitor": MonitorConfig,
    "swapper": SwapperConfig,
    "calibration": CalibrationConfig,
    "controller": ControllerConfig,  # its plain fields (credit_batches, standby_wait_s)
}


def _value(text: str, default: object) -> object:
    """``text`` as the type of the field's default (None-able fields take ``none``)."""
    if text.lower() == "none":
        return None
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float) or default is None:
        return float(text)
    return text


def tuned(values: list[str]) -> dict[str, dict[str, object]]:
    """``--tune SECTION.FIELD=VALUE`` settings, by section; a ValueError naming what is wrong otherwise."""
    out: dict[str, dict[str, object]] = {section: {} for section in TUNABLE}
    for item in values:
        key, sep, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in TUNABLE:
            raise ValueError(f"--tune takes SECTION.FIELD=VALUE with SECTION one of {', '.join(TUNABLE)}, got {item!r}")
        defaults = TUNABLE[section]()
        fields = [
            f.name for f in dataclasses.fields(defaults) if not dataclasses.is_dataclass(getattr(defaults, f.name))
        ]
        if name not in fields:
            raise ValueError(f"--tune: {section} has no field {name!r}; it has {', '.join(fields)}")
        default = getattr(defaults, name)
        try:
            out[section][name] = _value(text, default)
        except ValueError as exc:
            raise ValueError(f"--tune {key}: {exc}") from None
    return out


def config_from(args: argparse.Namespace) -> ControllerConfig:
    tune = tuned(args.tune)
    policy = {"up_confirm_s": args.up_confirm, "down_confirm_s": args.down_confirm, "min_gain": args.min_gain}
    return ControllerConfig(
        **tune["controller"],
        policy=PolicyConfig(**{**policy, **tune["policy"]}),
        monitor=MonitorConfig(**tune["monitor"]),
        swapper=SwapperConfig(**{"max_batch_delay_ms": args.max_batch_delay, **tune["swapper"]}),
        calibration=CalibrationConfig(**tune["calibration"]),
        standby_workers=args.standby_workers,
        calibrate=not args.no_calibrate,
        fixed_batch=args.fixed_batch,
        reconfigure=not args.no_reconfigure,
        share_cores=not args.no_share_cores,
        mixed_plans=args.mixed_plans,
        division=DivisionConfig(
            objective=args.share_objective, min_cores=args.min_cores, min_gain=args.division_min_gain,
            confirm_s=args.division_confirm,
        ),
    )  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    if args.log_config is not None and not args.log_config.is_file():  # before profiling, which takes minutes
        raise ValueError(f"--log-config: no log4j2 file at {args.log_config}")
    # The status server binds its port only once TorchServe serves: a free port chosen for TorchServe
    # must not be it (a controller once died on "Address already in use" there).
    ports = Ports.free(exclude=[args.status_port]) if args.free_ports else _ports_from(args.config)
    controller = PackratController(
        args.workdir, targets_from(args), config_from(args), ports=ports,
        status_port=args.status_port, base_config=args.config, inference_host=_inference_host(args.config),
        status_host=args.status_host, log_config=args.log_config,
    )  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        stack.enter_context(controller)
        print(f"Packrat serving on {controller.server.inference_url}; status at {controller.status_url}")
        if args.oip_grpc_port is not None:
            front = OipGrpcFront(controller.server.inference_url, controller.server.management_url,
                                 args.oip_grpc_port)  # fmt: skip
            stack.enter_context(front)
            print(
                f"Open Inference Protocol: HTTP at {controller.server.inference_url}/v2, gRPC at 127.0.0.1:{front.port}"
            )
        print(format_status(controller.status()))
        stop.wait()
    return 0


def add_oip_grpc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inference", default="http://127.0.0.1:8080", help="TorchServe's inference address")
    p.add_argument("--management", default="http://127.0.0.1:8081", help="TorchServe's management address")
    p.add_argument("--port", type=int, default=8085, help="the gRPC port to serve on (0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (loopback unless you mean otherwise)")


def run_oip_grpc(args: argparse.Namespace) -> int:
    """The Open Inference Protocol gRPC front alone, before any TorchServe (with or without Packrat)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with OipGrpcFront(args.inference, args.management, args.port, args.host) as front:
        print(f"Open Inference Protocol gRPC on {args.host}:{front.port}, answered by TorchServe at {args.inference}")
        stop.wait()
    return 0
