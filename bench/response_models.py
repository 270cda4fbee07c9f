"""What the query API's typed answers cost on a large grid: one `/ranks` answer (300
buckets of steps x 1,024 ranks, 307,200 values) serialised in-process three ways.

- untyped: what FastAPI does for an endpoint annotated `-> dict[str, Any]` and no
  response_model (the annotation is the model): validate as a dict of anything, then
  pydantic's JSON writer;
- typed: the same with the answer's model (collector/responses.py), every value checked;
- schema only: a response_model for /openapi.json, the endpoint returning its answer as a
  response of its own (orjson, as the collector's FastJSONResponse), nothing validated.

Each says whether its bytes equal the untyped ones. Then end to end through TestClient:
the served endpoint as the code stands (its SQL answer cached: what is left is
serialisation and HTTP), and the same answer from two routes added for the comparison, one
untyped (the endpoint before it had a model) and one validated against RankSeries.
Prints the medians, the headline on the last line.

    python bench/response_models.py --ranks 1024 --buckets 300
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from dashboard_scale import RUN_ID, build_store  # bench/, beside this script
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from trainvitals.collector.main import create_app
from trainvitals.collector.responses import RankSeries
from trainvitals.collector.settings import Settings

RANK_EVERY = 10


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--buckets", type=int, default=300, help="steps of rank rows (max_steps)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tv-response-models-") as tmp:
        store = Path(tmp) / "store.duckdb"
        steps = args.buckets * RANK_EVERY
        build_store(store, steps, args.ranks, 8, RANK_EVERY, RANK_EVERY)
        app = create_app(Settings(store_path=str(store), replay=True))
        with TestClient(app) as client:
            url = f"/api/v1/runs/{RUN_ID}/ranks"
            params = {"metric": "compute_time_s", "max_steps": args.buckets}
            served = client.get(url, params=params)
            assert served.status_code == 200, served.text
            answer = served.json()
            n_values = len(answer["value"])
            typed, untyped_adapter = TypeAdapter(RankSeries), TypeAdapter(dict[str, Any])
            ways = {
                "untyped": lambda: untyped_adapter.dump_json(
                    untyped_adapter.validate_python(answer)
                ),
                "typed": lambda: typed.dump_json(typed.validate_python(answer)),
                "schema only": lambda: orjson.dumps(answer),
            }
            untyped = ways["untyped"]()
            same = {name: fn() == untyped for name, fn in ways.items()}
            ms = {name: median_ms(fn, args.repeats) for name, fn in ways.items()}
            _comparison_routes(app, answer)
            served_ms = {
                "served": median_ms(lambda: client.get(url, params=params), args.repeats),
                **{
                    way: median_ms(lambda way=way: client.get(f"/bench/{way}"), args.repeats)
                    for way in ("untyped", "typed")
                },
            }
    print(f"/ranks answer: {n_values:,} values, {len(untyped) / 1e6:.1f} MB of JSON")
    for name in ways:
        print(f"  {name:12s} {ms[name]:8.1f} ms  bytes as untyped: {same[name]}")
    print(f"  endpoint as served: bytes as untyped: {served.content == untyped}")
    for way, t_ms in served_ms.items():
        print(f"  endpoint, {way:8s} {t_ms:8.1f} ms")
    print(
        f"headline: {n_values:,} values: untyped {ms['untyped']:.0f} ms, typed "
        f"{ms['typed']:.0f} ms, schema only {ms['schema only']:.0f} ms; end to end: served "
        f"{served_ms['served']:.0f} ms, untyped {served_ms['untyped']:.0f} ms, typed "
        f"{served_ms['typed']:.0f} ms"
    )


def _comparison_routes(app: FastAPI, answer: dict[str, Any]) -> None:
    """GET /bench/untyped and /bench/typed: `answer` as an endpoint without a model and
    one validated against RankSeries would serve it."""

    @app.get("/bench/untyped")
    def untyped() -> dict[str, Any]:
        return answer

    @app.get("/bench/typed", response_model=RankSeries)
    def typed() -> dict[str, Any]:
        return answer


if __name__ == "__main__":
    main()
