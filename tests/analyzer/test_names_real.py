"""Names, not indices, on real runs of the reference trainer (torchrun, gloo, CPU ranks):
what a bad batch, a NaN loss and a faulty rank are blamed for, and how they are named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_trainer
from trainvitals.analyzer import Analyzer
from trainvitals.schema import to_arrow

SPIKE_STEP = 30
NAN_STEP = 12


def _docs(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _alerts(docs: list[dict]) -> list:
    analyzer = Analyzer()
    return [a for doc in docs for a in analyzer.observe(*to_arrow(doc))]


def _run_row(docs: list[dict]) -> dict:
    runs = next(doc["runs"] for doc in docs if "runs" in doc)
    return {k: v[0] for k, v in runs.items()}


def _named_layers(message: str, names: list[str]) -> list[str]:
    """The layers `message` names: by index ('layer 2') or by a name that cannot be an
    English word ('layers.1', 'tok_embeddings'; 'output' and 'norm' can)."""
    found = re.findall(r"\blayer \d+", message)
    return found + [n for n in names if ("." in n or "_" in n) and n in message]


def _train(tmp_path: Path, name: str, *flags: str, nproc: int = 2) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    run_trainer(
        ["--dp", str(nproc), *flags, "--telemetry-file", str(out)], nproc=nproc, timeout_s=600
    )
    return _docs(out)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> list[dict]:
    """2 ranks, every step logged, the loss NaN at NAN_STEP."""
    tmp = tmp_path_factory.mktemp("nan")
    return _train(tmp, "nan", "--steps", str(NAN_STEP + 4), "--inject", f"nan:step={NAN_STEP}")


@pytest.mark.slow
def test_a_bad_batch_names_no_layer(tmp_path: Path) -> None:
    docs = _train(
        tmp_path, "spike", "--steps", str(SPIKE_STEP + 4),
        "--inject", f"spike:step={SPIKE_STEP},kind=batch",
    )  # fmt: skip
    names = json.loads(_run_row(docs)["layer_names_json"])
    (spike,) = [a for a in _alerts(docs) if a.kind == "loss_spike"]
    assert spike.step == SPIKE_STEP and spike.layer is None, spike.message
    assert "layers moved in the same step" in spike.message or "every layer" in spike.message
    assert not _named_layers(spike.message, names), spike.message


@pytest.mark.slow
def test_a_nan_loss_names_the_loss_not_a_layer(nan_run: list[dict]) -> None:
    names = json.loads(_run_row(nan_run)["layer_names_json"])
    (alert,) = [a for a in _alerts(nan_run) if a.kind == "nonfinite"]
    assert alert.step == NAN_STEP and alert.layer is None, alert.message
    assert "it started in the loss" in alert.message
    assert not _named_layers(alert.message, names), alert.message


@pytest.mark.slow
def test_a_nan_loss_between_logged_steps_is_named_before_the_outputs_it_poisoned(
    tmp_path: Path,
) -> None:
    # Logged every 5 steps: the loss goes NaN at step 12, the NaN update poisons every
    # output from step 13. Step 15 is the first logged step that shows either.
    docs = _train(
        tmp_path, "nan5", "--steps", "18", "--log-every", "5", "--inject", f"nan:step={NAN_STEP}"
    )
    (alert,) = [a for a in _alerts(docs) if a.kind == "nonfinite"]
    assert alert.step == 15 and alert.layer is None, alert.message
    assert "it started in the loss" in alert.message and "on 4 step(s)" in alert.message


def test_a_layer_is_named_as_the_run_names_it(nan_run: list[dict]) -> None:
    """The real run's runs row and layer statistics, with one value made non-finite by
    hand (no injected fault makes one layer's output NaN): the alert names that layer
    by the name the hooks gave it, and keeps its index."""
    names = json.loads(_run_row(nan_run)["layer_names_json"])
    index = names.index("layers.1")  # 2: index 0 is tok_embeddings
    docs = json.loads(json.dumps(nan_run))  # a deep copy
    for doc in docs:
        layers = doc.get("layers", {})
        steps, indices = layers.get("step", []), layers.get("layer", [])
        for i, (step, layer) in enumerate(zip(steps, indices, strict=True)):
            if (step, layer) == (5, index):
                layers["act_rms"][i] = "NaN"  # the wire form of a NaN
    alert = next(a for a in _alerts(docs) if a.kind == "nonfinite")
    assert (alert.step, alert.layer) == (5, index)
    assert "forward order: layers.1 (activations)" in alert.message


@pytest.mark.slow
def test_sdc_names_the_faulty_rank_with_its_host_and_blames_no_receiver(
    faulty_telemetry: Path,
) -> None:
    """A faulty unit on rank 2 (dp index 1, tp index 0; dp=2 x tp=2) from step 30: rank 0,
    the other group's member at tp index 0, sums rank 2's gradients and its copy of the
    replicated weights drifts too. The canary names rank 2; sdc_replica must blame rank 2
    and call rank 0 a receiver, never call replica group 0 corrupt."""
    docs = _docs(faulty_telemetry)
    hosts = json.loads(_run_row(docs)["hosts_json"])
    alerts = _alerts(docs)
    (canary,) = [a for a in alerts if a.kind == "sdc"]
    assert canary.rank == 2 and f"rank 2 on {hosts[2]}" in canary.message
    replica = [a for a in alerts if a.kind == "sdc_replica"]
    assert replica and all(a.rank == 2 for a in replica), [a.message for a in replica]
    first = replica[0].message
    assert f"rank 2 on {hosts[2]}" in first and "corrupt copy of replica group 1" in first
    assert f"rank 0 on {hosts[0]}" in first and "not at fault" in first
    for a in replica:
        assert "replica group 0 (" not in a.message and "group 0's" not in a.message
