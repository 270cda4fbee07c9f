"""The `trainvitals` command: one subcommand per job."""

from __future__ import annotations

import argparse
import signal
import sys
from collections import Counter
from typing import TYPE_CHECKING

from trainvitals import checks
from trainvitals import simulate as simulate_flags
from trainvitals.collector.memory import DEFAULT_MEMORY_LIMIT
from trainvitals.trainer import config as train_config

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    import duckdb

    from trainvitals.analyzer.config import AnalyzerConfig


def _train(args: argparse.Namespace, rest: list[str]) -> int:
    from trainvitals.trainer.launch import run

    cfg = train_config.from_args(args)  # validates before any process starts
    return run(cfg, args.nproc or cfg.world_size, rest)


COLLECTOR_STORE = "trainvitals.duckdb"  # the collector's default --store


def _collector(args: argparse.Namespace, _rest: list[str]) -> int | str:
    import uvicorn
    from pydantic import ValidationError

    from trainvitals.collector.main import create_app
    from trainvitals.collector.settings import Settings
    from trainvitals.collector.state import load_live_state
    from trainvitals.collector.store import Store, StoreError

    if isinstance(args.replay, str):  # --replay STORE, the short form of --store STORE --replay
        if args.store != COLLECTOR_STORE:
            return "error: name the store once: --replay STORE, or --store STORE --replay"
        args.store, args.replay = args.replay, True
    # Fail here, with one line, rather than in the server's start-up with a traceback; the
    # settings first, so that bad flags leave no store file behind.
    try:
        settings = Settings(
            store_path=args.store,
            retention_days=args.retention_days,
            memory_limit=args.memory_limit,
            host=args.host,
            port=args.port,
            replay=args.replay,
            **({"ingest_token": args.token} if args.token else {}),
            **({"read_token": args.read_token} if args.read_token else {}),
            **({"analyzer_config": args.analyzer_config} if args.analyzer_config else {}),
            **({"analyzer_set": args.set} if args.set else {}),
        )
        settings.analyzer()  # the detector settings, checked before anything starts
    except ValidationError as e:
        return "error: " + "; ".join(map(_setting_error, e.errors()))
    except ValueError as e:
        return f"error: {e}"
    try:
        # What the collector reads first (its live state): a damaged file is named here.
        store = Store(args.store, read_only=args.replay, memory_limit=args.memory_limit)
        load_live_state(store)  # closes the store if it cannot
        store.close()
    except StoreError as e:
        return f"error: {e}"

    mode = "replaying" if args.replay else "collecting into"
    print(
        f"trainvitals collector on http://{args.host}:{args.port} {mode} {args.store}", flush=True
    )
    # uvicorn shuts down gracefully on SIGTERM (the store flushed and closed), then raises
    # the signal again to the previous handler: a no-op one makes the exit status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="warning")
    return 0


# The flag that sets each Settings field; the other fields come from TRAINVITALS_* variables.
_SETTING_FLAGS = {
    "store_path": "--store",
    "ingest_token": "--token",
    "read_token": "--read-token",
    "host": "--host",
    "port": "--port",
    "retention_days": "--retention-days",
    "memory_limit": "--memory-limit",
    "analyzer_config": "--analyzer-config",
}


def _setting_error(error: Mapping[str, Any]) -> str:
    """'--port: Input should be ...' from one of pydantic's errors."""
    name = str(error["loc"][0]) if error["loc"] else ""
    where = _SETTING_FLAGS.get(name, f"TRAINVITALS_{name.upper()}")
    return f"{where}: {error['msg'].removeprefix('Value error, ')}"


def _dashboard(args: argparse.Namespace, _rest: list[str]) -> int | str:
    from pathlib import Path

    from trainvitals.dashboard.launch import run_dashboard, run_replay

    if args.store is None:
        checks.http_url("--collector", args.collector)
        return run_dashboard(args.collector, port=args.port, host=args.host)
    try:
        return run_replay(Path(args.store), port=args.port, host=args.host)
    except RuntimeError as e:  # the replay collector did not start; it said why above
        return f"error: {e}"


def _demo(args: argparse.Namespace, _rest: list[str]) -> int:
    from trainvitals.demo import run_demo

    return run_demo(args)


def _plan(args: argparse.Namespace, _rest: list[str]) -> int:
    from trainvitals.plan import describe, plan

    p = plan(args.params, args.tokens, args.gpu, args.count, args.mfu, args.precision, args.power_w)
    print(describe(p))
    return 0


def _supervise(args: argparse.Namespace, job: list[str]) -> int | str:
    from trainvitals.supervisor.main import run

    return run(args, job)


def _import(args: argparse.Namespace, _rest: list[str]) -> int:
    from pathlib import Path

    from trainvitals.importer import run_import

    return run_import(Path(args.path), args.collector, args.token, args.batch_rows)


def _replay(args: argparse.Namespace, _rest: list[str]) -> int | str:
    from pathlib import Path

    import duckdb

    from trainvitals.collector.store import Store, StoreError, damaged
    from trainvitals.collector.stored import check_source

    comparable_alerts = check_source(Path(args.store))  # ValueError: one line, from main
    config = _analyzer_config(args)  # ValueError: one line, from main
    # The collector's read-only Store, as `collector --replay` reads: its views fill the
    # columns and tables an older store lacks with NULL, and serve an export folder too.
    try:
        store = Store(args.store, read_only=True)
    except StoreError as e:
        return f"error: {e}"
    try:
        return _replay_store(store.cursor(), args, comparable_alerts, config)
    except duckdb.Error as e:  # a damaged file, Parquet that cannot be read
        return f"error: {damaged(args.store, e)}"
    finally:
        store.close()


def _print_differences(only_replayed: Counter, only_live: Counter) -> None:
    """The alerts only one side raised (`comparable` tuples), so that a mismatch names
    them (stderr)."""
    for side, alerts in (("replayed only", only_replayed), ("live only", only_live)):
        for run_id, step, kind, rank, layer, message in sorted(alerts.elements(), key=repr):
            where = "the run" if rank is None and layer is None else f"rank {rank}, layer {layer}"
            print(f"  {side}: {run_id} step {step} {kind} ({where}): {message[:160]}",
                  file=sys.stderr)  # fmt: skip


def _replay_store(
    con: duckdb.DuckDBPyConnection,
    args: argparse.Namespace,
    comparable_alerts: bool,
    config: AnalyzerConfig,
) -> int:
    import orjson

    from trainvitals.analyzer.replay import comparable, replay_store, store_goodput, stored_alerts

    replayed = []
    for alert in replay_store(con, config):
        replayed.append(alert.to_dict())
        sys.stdout.buffer.write(orjson.dumps(alert.to_dict()) + b"\n")
    if comparable_alerts:
        live = stored_alerts(con)
        replayed_n, live_n = Counter(map(comparable, replayed)), Counter(map(comparable, live))
        only_replayed, only_live = replayed_n - live_n, live_n - replayed_n
        same = not only_replayed and not only_live
        verdict = "identical to" if same else "DIFFERENT from"
        print(f"{len(replayed)} alerts replayed, {verdict} the {len(live)} the collector raised",
              file=sys.stderr)  # fmt: skip
        if not same:
            _print_differences(only_replayed, only_live)
    else:  # --check cannot pass: there is nothing to check against
        same = False
        print(f"{len(replayed)} alerts replayed; not compared: {args.store} has no alerts "
              "table (a store from a version that did not keep the live alerts)",
              file=sys.stderr)  # fmt: skip
    # Goodput per run: a line for people, then the same as JSON (stdout stays alerts only).
    for g in store_goodput(con):
        print(g.summary(), file=sys.stderr)
        print("goodput " + orjson.dumps(g.to_dict()).decode(), file=sys.stderr)
    return 0 if same or not args.check else 1


def _analyze(args: argparse.Namespace, _rest: list[str]) -> int:
    from pathlib import Path

    import orjson

    from trainvitals.analyzer.offline import analyze_file

    named = {
        "step": args.step_column,
        "loss": args.loss_column,
        "grad_norm": args.grad_norm_column,
        "lr": args.lr_column,
    }
    overrides = {k: v for k, v in named.items() if v}
    config = _analyzer_config(args)
    for alert in analyze_file(Path(args.file), overrides, config, args.loss_scaling):
        sys.stdout.buffer.write(orjson.dumps(alert.to_dict()) + b"\n")
    return 0


def _analyzer_config(args: argparse.Namespace) -> AnalyzerConfig:
    """The detector settings of --analyzer-config and --set (no environment variables: a
    replay or an analysis should not depend on the shell it runs in)."""
    from trainvitals.analyzer.config import AnalyzerConfig

    return AnalyzerConfig.load(args.analyzer_config or None, args.set)


def _config(args: argparse.Namespace, _rest: list[str]) -> int:
    sys.stdout.write(_analyzer_config(args).to_toml())
    return 0


def _add_analyzer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--analyzer-config", default="", metavar="FILE",
        help="detector settings, TOML or JSON (`trainvitals config` prints the defaults)",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="one detector setting, e.g. stall.min_gap_s=30 (repeatable; wins over the file)",
    )  # fmt: skip


def _export(args: argparse.Namespace, _rest: list[str]) -> int | str:
    import duckdb

    from trainvitals.collector.export import export_store
    from trainvitals.collector.store import StoreError, damaged

    try:
        written = export_store(args.store, args.out, args.run or None)
    except StoreError as e:
        return f"error: {e}"
    except duckdb.Error as e:  # a block past the end of a truncated file, met mid-export
        return f"error: {damaged(args.store, e)}"
    print(", ".join(f"{n} {t}" for t, n in written.items()) + f" rows written to {args.out}")
    return 0


def _simulate(args: argparse.Namespace, _rest: list[str]) -> int | str:
    from trainvitals.simulate import from_args, simulate

    spec = from_args(args)  # validates every flag before anything is sent
    docs = simulate(spec, per_node=args.per_node)
    if args.out:
        from trainvitals.schema import encode_json

        n = _write_atomically(args.out, (encode_json(doc) + b"\n" for doc in docs))
        print(f"run {spec.run_id}: {n} batches written to {args.out}")
        return 0
    from trainvitals.sender import send

    report = send(
        docs,
        args.collector,
        connections=args.connections,
        batch_points=args.batch_points,
        token=args.token,
        wire=args.wire,
        attempts=args.attempts,
    )
    print(f"run {spec.run_id}: {report.summary()}")
    for detail in report.rejected[:5]:
        print(f"rejected: {detail}", file=sys.stderr)
    for detail in report.undelivered[:5]:  # no answer, or only "retry later"
        print(f"not delivered after {args.attempts} attempts: {detail}", file=sys.stderr)
    return 1 if report.rejected or report.undelivered else 0


def _write_atomically(path: str, lines) -> int:
    """Write `lines` to a file beside `path`, then rename it to `path`; returns the count.

    Whatever stops the writing (an error, Ctrl-C) leaves `path` as it was and no partial
    file: `trainvitals import` of a half-written file would load half a run.
    """
    import os
    from pathlib import Path

    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"--out {path}: folder {target.parent} does not exist")
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    n = 0
    try:
        with partial.open("wb") as f:
            for n, line in enumerate(lines, start=1):  # noqa: B007 - n counts the lines
                f.write(line)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)  # gone already when the rename succeeded
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainvitals", description="Health monitoring for distributed training runs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="run the reference Llama trainer (torchrun for several ranks)",
        description="Train the reference Llama-style model on FSDP2 x TP with trainvitals hooks.",
    )
    p.add_argument("--nproc", type=int, default=0, help="local ranks to launch (default: dp x tp)")
    train_config.add_arguments(p)
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "collector",
        help="run the collector (ingest, DuckDB store, /metrics, query API)",
        description="Serve ingest, Prometheus /metrics and the query API over a DuckDB store.",
    )
    p.add_argument("--store", default=COLLECTOR_STORE, help="DuckDB file (created if missing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--replay", nargs="?", const=True, default=False, metavar="STORE",
        help="serve a stored run read-only and refuse ingest: the --store, or STORE "
        "(a DuckDB file or an export folder)",
    )  # fmt: skip
    p.add_argument(
        "--token", default="",
        help="require this bearer token on writes (ingest, OTLP, heartbeats), and on reads "
        "unless --read-token is given (or TRAINVITALS_INGEST_TOKEN)",
    )  # fmt: skip
    p.add_argument(
        "--read-token", default="",
        help="require this bearer token on reads: query API, /metrics, /docs (or "
        "TRAINVITALS_READ_TOKEN); /healthz and /readyz stay open",
    )  # fmt: skip
    p.add_argument(
        "--retention-days", type=float, default=0,
        help="drop runs whose last step is older than this (default 0: keep every run)",
    )  # fmt: skip
    p.add_argument(
        "--memory-limit", default=DEFAULT_MEMORY_LIMIT,
        help=f"most memory the store's DuckDB may use, e.g. 4GB (default {DEFAULT_MEMORY_LIMIT})",
    )  # fmt: skip
    _add_analyzer_flags(p)
    p.set_defaults(func=_collector)

    p = sub.add_parser(
        "dashboard",
        help="run the Streamlit dashboard against a collector, or replay a stored run",
        description="Serve the dashboard, reading a collector's query API; with --store, "
        "start a read-only collector on that store first (a post-mortem). Ctrl-C stops both.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--collector", default="http://127.0.0.1:8000", help="collector base URL")
    source.add_argument(
        "--store", help="DuckDB store or Parquet export folder to replay (instead of --collector)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8501)
    p.set_defaults(func=_dashboard)

    p = sub.add_parser(
        "demo",
        help="collector + dashboard + a 4-rank CPU training run, together",
        description="Start the whole stack on this machine; Ctrl-C stops everything.",
    )
    p.add_argument("--store", default="demo-data/demo.duckdb", help="DuckDB file of the demo")
    p.add_argument("--collector-port", type=int, default=8000, help="default 8000")
    p.add_argument("--dashboard-port", type=int, default=8501, help="default 8501")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument(
        "--no-dashboard", action="store_true", help="skip the dashboard (headless check)"
    )
    p.add_argument("--exit-when-done", action="store_true", help="stop when training ends")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "import",
        help="load a telemetry file, spool directory or Parquet export into a collector",
        description="Send recorded telemetry (a --telemetry-file, a spool directory, or a "
        "folder written by `trainvitals export`) to a collector through its ingest API. "
        "Safe to repeat: nothing is stored twice.",
    )
    p.add_argument(
        "path", help="JSON-lines telemetry file, spool directory, or Parquet export folder"
    )
    p.add_argument("--collector", default="http://127.0.0.1:8000", help="collector base URL")
    p.add_argument("--token", default="", help="bearer token, if the collector requires one")
    p.add_argument(
        "--batch-rows", type=_positive_int, default=5000,
        help="rows per batch sent from a Parquet export (default 5000; whole steps)",
    )  # fmt: skip
    p.set_defaults(func=_import)

    p = sub.add_parser(
        "replay",
        help="run the detectors over a stored run, as the live collector did",
        description="Replay a stopped collector's DuckDB store (or a folder written by "
        "`trainvitals export`) through the analyzer in step order; print alerts as JSON lines "
        "and compare them with the stored live alerts.",
    )
    p.add_argument("store", help="DuckDB file of a stopped collector, or an export folder")
    p.add_argument("--check", action="store_true", help="exit 1 if replay and live differ")
    _add_analyzer_flags(p)
    p.set_defaults(func=_replay)

    p = sub.add_parser(
        "analyze",
        help="run the detectors over a CSV or Parquet of step metrics from another tool",
        description="Map a scalar export (W&B, TensorBoard) onto step fields by column name "
        "and print the alerts as JSON lines.",
    )
    p.add_argument("file", help=".csv or .parquet with a step column and a loss column")
    p.add_argument("--step-column", default="", help="name of the step column, if not guessed")
    p.add_argument("--loss-column", default="", help="name of the loss column, if not guessed")
    p.add_argument(
        "--grad-norm-column", default="", help="name of the gradient-norm column, if not guessed"
    )
    p.add_argument(
        "--lr-column", default="", help="name of the learning-rate column, if not guessed"
    )
    p.add_argument(
        "--loss-scaling", choices=("none", "dynamic"), default="none",
        help="dynamic: the run used a dynamic loss scaler (fp16's GradScaler), whose overflows "
        "(a non-finite gradient norm, finite loss) are skipped steps, not alerts",
    )  # fmt: skip
    _add_analyzer_flags(p)
    p.set_defaults(func=_analyze)

    p = sub.add_parser(
        "config",
        help="print the detector settings in force, as a TOML file to start from",
        description="Print every detector setting (defaults, then --analyzer-config, then --set) "
        "as TOML that --analyzer-config reads back.",
    )
    _add_analyzer_flags(p)
    p.set_defaults(func=_config)

    p = sub.add_parser(
        "export",
        help="write a stopped store's runs as hive-partitioned Parquet",
        description="Export a DuckDB store (stop its collector first) to zstd Parquet, one "
        "folder per table, partitioned by run_id. `collector --replay OUT` serves it.",
    )
    p.add_argument("store", help="DuckDB file of a stopped collector")
    p.add_argument("out", help="new folder for the export")
    p.add_argument("--run", default="", help="only this run (default: every run)")
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "simulate",
        help="simulate the telemetry of an N-rank job, with faults, into a collector or a file",
        description="Generate realistic telemetry of a training job (timing, power, losses, "
        "per-layer and per-rank statistics, SDC fingerprints), inject faults with ground "
        "truth as events, and send it to a collector (binary msgpack, several connections) "
        "or write it as JSON lines (`trainvitals import` loads them).",
    )
    simulate_flags.add_arguments(p)  # one per FleetSpec field
    p.add_argument("--per-node", action="store_true", help="send ranks rows in one batch per node")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--collector", help="collector base URL, e.g. http://127.0.0.1:8000")
    where.add_argument("--out", help="write JSON lines to this file instead")
    p.add_argument("--connections", type=int, default=4, help="concurrent connections")
    p.add_argument("--batch-points", type=int, default=250_000, help="values per request")
    p.add_argument("--wire", choices=["msgpack", "json"], default="msgpack")
    p.add_argument(
        "--attempts", type=_positive_int, default=150,
        help="sends of a batch the collector does not take (no answer, 503) before giving "
        "up on it: 2 s apart after the first few (default 150, about 5 minutes)",
    )  # fmt: skip
    p.add_argument("--token", default="", help="bearer token, if the collector requires one")
    p.set_defaults(func=_simulate)

    p = sub.add_parser(
        "supervise",
        help="run a job under torchrun, act on its alerts by policy (fence, roll back, resume)",
        description="Launch the job's command (after --) under torchrun, one agent per node; "
        "read the run's alerts from the collector (or an Alertmanager webhook) and, per the "
        "policy, recommend or carry out: fence a node, roll back to a clean checkpoint, "
        "relaunch on the nodes left. docs/supervisor.md.",
    )
    from trainvitals.supervisor.main import add_arguments as supervise_arguments

    supervise_arguments(p)
    p.set_defaults(func=_supervise)

    p = sub.add_parser(
        "plan",
        help="FLOPs, days and energy of a training run, before it starts",
        description="Estimate a run's compute (6 N D), wall time and energy.",
    )
    p.add_argument("--params", type=float, required=True, help="parameters, e.g. 1e11")
    p.add_argument("--tokens", type=float, required=True, help="training tokens, e.g. 1.5e13")
    p.add_argument("--gpu", required=True, help="device, a key of the peak table, e.g. H100")
    p.add_argument("--count", type=int, required=True, help="number of devices")
    p.add_argument("--mfu", type=float, default=0.4, help="expected MFU, 0..1 (default 0.4)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    p.add_argument(
        "--power-w", type=float, default=None, help="power per device (default: board power)"
    )
    p.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    job: list[str] = []
    if argv[:1] == ["supervise"] and "--" in argv:  # supervise's flags -- the job's command
        argv, job = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = build_parser().parse_args(argv)
    rest = argv[1:] if args.command == "train" else job
    if args.command == "train":
        # The trainer gets the train flags verbatim, minus --nproc.
        rest = _without_flag(rest, "--nproc")
    try:
        sys.exit(args.func(args, rest))
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out
