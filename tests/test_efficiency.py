"""``python -m repro study efficiency`` on CPU (one process per run, and two under torchrun): its records, table and summary, its
configuration against the papers' batch, its refusals (DirMoE compiled against eager: tests/test_dirmoe_compile.py)."""

from __future__ import annotations

import csv
import dataclasses
import gc
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from repro.cli import main as cli_main
from repro.config import RunConfig
from repro.errors import ReproError
from repro.records.step_log import read_rows
from repro.records.store import load_record
from repro.studies.efficiency import efficiency_config, efficiency_overrides

#: The markers of the efficiency study's run and output directories (repro.studies.engine's scheme).
RUN_MARKER, OUT_MARKER = ".efficiency-run", ".efficiency-out"

REPO = Path(__file__).resolve().parents[1]
# Small and quick: the tiny flavour, a small synthetic vocabulary, one warm-up and two measured iterations.
FAST = ["--vocab-size", "256", "--warmup", "1", "--iters", "2"]
TABLE_COLUMNS = [
    "Router", "ms/iter", "TFLOP/s/dev (analytic)", "TFLOP/s/dev (measured)", "tokens/s", "peak mem (GiB)",
    "active experts", "token group", "devices", "device", "backend", "compute parity",
]


def _times_ms(run_dir: Path) -> list[float]:
    return [row.iter_time_s * 1e3 for row in read_rows(run_dir)]


# ------------------------------------------------------------------------------------------ the command
@pytest.mark.slow
def test_two_routers_and_dense_on_one_cpu_device(tmp_path, capsys):
    out = tmp_path / "eff"
    argv = ["study", "efficiency", "--router", "switch,dirmoe,dense", "--vocab-size", "256", "--warmup", "1", "--iters", "4"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    switch_times = _times_ms(out / "runs" / "switch")[1:5]

    for label in ("switch", "dirmoe", "dense"):
        run_dir = out / "runs" / label
        record = load_record(run_dir / "record.json")
        env, eff = record.environment, record.efficiency
        assert record.run_id == label and record.experiment.router == label and record.experiment.model.startswith("tiny")
        assert env.num_processes == 1 and env.device.startswith("cpu")
        assert env.torch == torch.__version__ and env.megatron_core == metadata.version("megatron-core")
        assert eff.backend == "local" and eff.num_devices == 1
        assert (eff.warmup_steps, eff.window_steps) == (1, 4)
        # the tiny recipe's per-device work: micro-batch 4 x 2 accumulation steps of 128 tokens
        assert (eff.global_batch_size, eff.seq_length) == (8, 128)
        config = json.loads((run_dir / "config.json").read_text())
        assert config["experiment"]["data"]["source"] == "synthetic" and config["vocab_size"] == 256
        assert config["num_microbatches"] == 2
        # the training built exactly the configuration the command planned
        assert RunConfig.from_dict(config["experiment"]) == efficiency_config(label, "tiny", steps=6, vocab_size=256)
        # stopped after warm-up + measured iterations + the one that collects routing metrics: no checkpoint
        times = _times_ms(run_dir)
        assert len(times) == 6 and not (run_dir / "checkpoints").exists()
        assert [r.metrics_collected for r in read_rows(run_dir)] == [True, False, False, False, False, True]
        assert (run_dir / RUN_MARKER).is_file()
        # the median is over the measured iterations only, none of which computed routing metrics
        entry = summary["runs"][label]
        assert entry["iter_time_ms"] == {"min": min(times[1:5]), "median": statistics.median(times[1:5]), "max": max(times[1:5])}
        assert eff.iter_time_ms == pytest.approx(entry["iter_time_ms"]["median"])
        # stepped in turn in one process: step s of every log is round s; the ratio is their geometric mean
        if label != "switch":
            ratio = entry["interleaved"]
            expected = statistics.geometric_mean([t / r for t, r in zip(times[1:5], switch_times)])
            assert entry["ratio_to_switch"] == ratio["ratio"] == pytest.approx(expected)
            assert ratio["low"] <= ratio["ratio"] <= ratio["high"] and (ratio["rounds"], ratio["batches"]) == (4, 2)
            assert ratio["device"] is None  # no CUDA events on CPU
    assert summary["interleaved"] is True and summary["runs"]["switch"]["ratio_to_switch"] == 1.0
    assert summary["dirmoe_over_switch"] == summary["runs"]["dirmoe"]["ratio_to_switch"]
    assert summary["published_dirmoe_over_switch"] == pytest.approx(437.3 / 431.5)
    assert (summary["tokens_per_iteration"], summary["devices"], summary["failed"]) == (8 * 128, 1, [])
    assert summary["command"].startswith("python -m repro study efficiency --router switch,dirmoe,dense")

    with open(out / "efficiency.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == TABLE_COLUMNS
    assert sorted(r[0] for r in rows[1:]) == ["dense", "dirmoe", "switch"]
    assert all(r[8] == "1" and r[10] == "local" for r in rows[1:])
    assert "Tokens per iteration: 8 x 128 = 1,024" in (out / "efficiency.md").read_text()
    assert "\\begin{table}" in (out / "efficiency.tex").read_text()
    assert "DirMoE / Switch, stepped in turn in one process" in capsys.readouterr().out

    # --separate: a fresh process per run, and no ratio formed between processes
    separate = tmp_path / "separate"
    assert cli_main([*argv, "--separate", "--router", "switch,dirmoe", "--out", str(separate)]) == 0
    summary = json.loads((separate / "summary.json").read_text())
    assert summary["interleaved"] is False and summary["dirmoe_over_switch"] is None
    assert all(e["ratio_to_switch"] is None and e["interleaved"] is None for e in summary["runs"].values())
    assert "No ratios" in capsys.readouterr().out


def test_interleaved_runs_step_in_turn_with_the_collector_off(tmp_path, monkeypatch):
    from repro.training import trainer as trainer_module
    from repro.training.interleave import round_order, train_interleaved

    assert [round_order(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    seen = []
    original = trainer_module.Trainer.train_step

    def spy(self):
        seen.append((self.config.name, gc.isenabled()))
        return original(self)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", spy)
    runs = [(r, efficiency_config(r, "tiny", steps=4, vocab_size=256), tmp_path / r) for r in ("switch", "dirmoe")]
    runs = [(label, dataclasses.replace(config, name=label), d) for label, config, d in runs]
    assert train_interleaved(runs, steps=4) == {"switch": 4, "dirmoe": 4}
    # A B, B A, A B, B A; the collector never on inside a step, and back on afterwards
    assert [name for name, _ in seen] == ["switch", "dirmoe", "dirmoe", "switch"] * 2
    assert not any(enabled for _, enabled in seen) and gc.isenabled()
    for label in ("switch", "dirmoe"):
        assert [r.step for r in read_rows(tmp_path / label)] == [1, 2, 3, 4]
        assert not (tmp_path / label / "checkpoints").exists()


def test_an_interleaved_run_traces_its_own_step_and_no_other(tmp_path):
    """``logging.trace_step`` of one interleaved run (the GPU check's traced warm-up step): the profiler wraps that
    run's own step only, so its summary counts its router calls, the other run gets no trace and both logs are whole."""
    from repro.config import apply_overrides
    from repro.training.interleave import train_interleaved

    runs = []
    for router, sets in (("switch", []), ("dirmoe", ["logging.trace_step=2"])):
        config = apply_overrides(efficiency_config(router, "tiny", steps=3, vocab_size=256), sets)
        runs.append((router, dataclasses.replace(config, name=router), tmp_path / router))
    assert train_interleaved(runs, steps=3) == {"switch": 3, "dirmoe": 3}
    summary = json.loads((tmp_path / "dirmoe" / "trace" / "summary.json").read_text())
    config = runs[1][1]
    micro_batches = config.data.global_batch_size // config.data.micro_batch_size
    assert summary["step"] == 2 and summary["router_calls"] == config.model.flavour_config().num_layers * micro_batches
    assert not (tmp_path / "switch" / "trace").exists()
    assert [[r.step for r in read_rows(tmp_path / label)] for label in ("switch", "dirmoe")] == [[1, 2, 3]] * 2


def _signal_at_round(monkeypatch, round_index: int) -> None:
    """A stop signal to this process as round ``round_index`` starts (as ``timeout --signal=INT`` sends one)."""
    from repro.training import interleave

    order = interleave.round_order

    def signalling(labels, index):
        if index == round_index:
            os.kill(os.getpid(), signal.SIGUSR1)  # SIGINT would also stop it; SIGUSR1 cannot reach pytest's handler
        return order(labels, index)

    monkeypatch.setattr(interleave, "round_order", signalling)


def test_a_stop_signal_ends_the_interleaved_runs_after_the_round_every_run_at_one_step(tmp_path, monkeypatch):
    from repro.training.interleave import train_interleaved

    _signal_at_round(monkeypatch, 2)
    runs = [(r, dataclasses.replace(efficiency_config(r, "tiny", steps=9, vocab_size=256), name=r), tmp_path / r)
            for r in ("switch", "dirmoe")]
    assert train_interleaved(runs, steps=8) == {"switch": 3, "dirmoe": 3}
    assert [[r.step for r in read_rows(tmp_path / label)] for label in ("switch", "dirmoe")] == [[1, 2, 3]] * 2
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler is gone with the rounds


def test_a_stopped_efficiency_command_still_reports_what_it_measured(tmp_path, monkeypatch, capsys):
    """gpu_measure.sh stops a phase at its time limit with SIGINT: the command writes its records, tables and
    summary from the rounds done (the same for every run), says where it stopped, and exits 1."""
    _signal_at_round(monkeypatch, 9)
    out = tmp_path / "eff"
    argv = ["study", "efficiency", "--router", "switch,dirmoe", "--vocab-size", "256", "--warmup", "1", "--iters", "40"]
    assert cli_main([*argv, "--out", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_after"] == 10 and summary["failed"] == []
    counts = {label: run["iterations"] for label, run in summary["runs"].items()}
    assert counts == {"switch": 9, "dirmoe": 9}  # 10 steps, 1 of them warm-up
    assert summary["runs"]["dirmoe"]["interleaved"]["rounds"] >= 4 and (out / "efficiency.md").is_file()
    assert "stopped by a signal after step 10" in capsys.readouterr().out


def test_a_run_stopped_within_its_warm_up_is_a_failed_row_that_says_so(tmp_path, monkeypatch):
    _signal_at_round(monkeypatch, 0)
    out = tmp_path / "eff"
    argv = ["study", "efficiency", "--router", "switch,hash", "--vocab-size", "256", "--warmup", "2", "--iters", "9"]
    assert cli_main([*argv, "--out", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_after"] == 1 and summary["failed"] == ["hash", "switch"]
    assert all(run["error"].startswith("stopped after 1 of ") for run in summary["runs"].values())


def test_interleaved_refuses_what_one_process_cannot_step_in_turn(tmp_path):
    from repro.training.interleave import train_interleaved

    config = efficiency_config("switch", "tiny", steps=4, vocab_size=256)
    with pytest.raises(ReproError, match="parallel.tp = ep = 1"):
        train_interleaved([("s", dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, ep=2)),
                            tmp_path / "s")], steps=4)
    with pytest.raises(ReproError, match="schedule.steps"):
        train_interleaved([("s", config, tmp_path / "s")], steps=config.schedule.steps)
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_processes_through_torchrun(tmp_path):
    out = tmp_path / "eff2"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "repro", "study", "efficiency", "--router", "dirmoe", "--gpus", "2", *FAST, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = load_record(out / "runs" / "dirmoe" / "record.json")
    assert record.environment.num_processes == 2 and record.efficiency.num_devices == 2
    # per device as on one: micro-batch 4 x 2 steps, so 16 sequences per iteration over both processes
    assert record.efficiency.global_batch_size == 16
    config = json.loads((out / "runs" / "dirmoe" / "config.json").read_text())
    assert config["layout"]["world_size"] == 2 and config["num_microbatches"] == 2
    # the child built exactly the configuration the command planned
    planned = efficiency_config("dirmoe", "tiny", devices=2, steps=4, vocab_size=256)
    assert RunConfig.from_dict(config["experiment"]) == planned
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["global_batch_size"] == 16
    assert len(_times_ms(out / "runs" / "dirmoe")) == 4


def test_the_papers_batch_on_eight_gpus_and_its_per_gpu_work_on_one():
    """The default keeps the papers' per-GPU work: 16 x 4 sequences of 1024 per GPU, 512 on 8 GPUs."""
    eight = efficiency_config("switch", "185m", devices=8, steps=23)
    one = efficiency_config("dirmoe", "185m", devices=1, steps=23)
    assert eight.data.global_batch_size == 512 and eight.data.micro_batch_size == 16 and eight.seq_length == 1024
    assert eight.data.num_microbatches(8) == 4 and one.data.num_microbatches(1) == 4
    assert one.data.global_batch_size == 64
    for config in (eight, one):
        assert (config.data.source, config.data.vocab_size) == ("synthetic", 50257)
        assert (config.checkpoint.interval, config.validation.interval) == (0, 0)
        assert config.schedule.steps == 60_000 and config.model.precision == "bf16"  # the recipe's run, stopped early
    assert one.optimizer.beta2 == 0.995  # DirMoE's declared recipe overrides are kept
    # overrides after the command's own; the global batch follows the micro-batch they set
    custom = efficiency_overrides("switch", "185m", devices=2, steps=5, overrides=["data.micro_batch_size=8"])
    assert custom[-1] == "data.global_batch_size=64"  # 8 x 4 x 2
    # Lory's dense start (its first 5% of steps) is off: the iterations measured are the routed model's.
    lory = efficiency_config("lory", "185m", devices=1, steps=23)
    assert lory.router.options["dense_fraction"] == 0 and "dense_fraction" not in one.router.options
    kept = efficiency_config("lory", "tiny", steps=5, overrides=["router.options.dense_fraction=0.1"])
    assert kept.router.options["dense_fraction"] == 0.1  # an explicit --set still wins


def _error(capsys, argv: list[str]) -> str:
    assert cli_main(["study", "efficiency", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--router", "nope"], "--router: unknown router 'nope'"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "two"], "argument --gpus: invalid int value"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--flavour", "huge"], "unknown flavour 'huge'; valid: 185m, tiny"),
        (["--flavour", "185m"], "trains in bf16, which needs a GPU"),
        (["--variant", "dirmoe"], "--variant expects LABEL=ROUTER"),
        (["--variant", "x=nope"], "unknown router 'nope'"),
        (["--variant", "switch=dirmoe", "--router", "switch"], "run label(s) given twice: switch"),
        (["--set", "schedule.nope=1"], "schedule.nope"),
        (["--variant", "d=dirmoe,router.options.compile_elementwise=sometimes"], "compile_elementwise must be one of"),
        (["--accumulation", "2", "--global-batch", "8"], "not both"),
        (["--global-batch", "6"], "not a multiple of micro-batch x data-parallel size = 4 x 1"),
        (["--set", "data.global_batch_size=16"], "--set data.global_batch_size: use --global-batch or --accumulation"),
        (["--format", "pdf"], "unknown table format(s) pdf"),
        (["--flops-attention", "half"], "argument --flops-attention: invalid choice: 'half'"),
        (["--variant", "s=switch,model.fused_cross_entropy=cce"],
         "s: model.fused_cross_entropy=cce needs cut-cross-entropy==25.1.1"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path):
    if torch.cuda.is_available() and "185m" in argv:
        pytest.skip("bf16 is available on a GPU")
    if "cce" in str(argv) and importlib.util.find_spec("cut_cross_entropy"):
        pytest.skip("cut-cross-entropy is installed")
    out = tmp_path / "out"
    assert message in _error(capsys, [*argv, "--out", str(out)])
    assert not out.exists()


def test_outputs_it_did_not_write_are_refused_and_left_alone(capsys, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    assert "was not written by python -m repro study efficiency" in _error(capsys, ["--router", "switch", "--out", str(foreign)])
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    ours = tmp_path / "ours"
    (ours / "runs" / "hash").mkdir(parents=True)
    (ours / OUT_MARKER).write_text("")
    (ours / "runs" / "hash" / "log.jsonl").write_text("not ours")
    assert "runs/hash: exists and was not created" in _error(capsys, ["--router", "hash", "--out", str(ours)])
    assert (ours / "runs" / "hash" / "log.jsonl").read_text() == "not ours"

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is not a directory" in _error(capsys, ["--router", "switch", "--out", str(afile)])


def test_an_earlier_output_keeps_the_runs_not_asked_for_again(tmp_path):
    from repro.studies.efficiency import parse
    from repro.studies.engine import claim

    out = tmp_path / "eff"
    for run in ("switch", "dense"):
        (out / "runs" / run).mkdir(parents=True)
        (out / "runs" / run / RUN_MARKER).write_text("")
        (out / "runs" / run / "log.jsonl").write_text(f"{run}'s earlier log")
    (out / OUT_MARKER).write_text("")
    plan = parse(["--router", "dense", "--out", str(out)], "efficiency")
    claim(plan.study(), fresh=True)
    assert (out / "runs" / "switch" / "log.jsonl").read_text() == "switch's earlier log"
    assert sorted(p.name for p in (out / "runs" / "dense").iterdir()) == [RUN_MARKER]  # fresh for the new run


def test_the_flops_count_is_causal_by_default_and_full_on_request(tmp_path):
    from repro.studies.efficiency import parse

    one = ["--router", "switch"]  # planning every router's run takes seconds
    assert parse([*one, "--out", str(tmp_path / "a")], "efficiency").flops_attention == "causal"
    assert parse([*one, "--flops-attention", "full", "--out", str(tmp_path / "b")], "efficiency").flops_attention == "full"


def test_refused_under_an_outer_torchrun(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "without torchrun" in _error(capsys, ["--out", str(tmp_path / "o")])


# ------------------------------------------------------------------------- from trained checkpoints
#: A trained tiny DirMoE: dense dispatch (every expert) for its first 3 steps, sparse after; the efficiency
#: run must time it sparse, at the checkpoint's step, not dense as a run from step 0 would.
DENSE_STEPS = ["--set", "router.options.dense_steps=3"]


def _train_tiny(router: str, out: Path, steps: int = 3) -> None:
    """The training command, in this process (the efficiency run that starts from it has a process of its own)."""
    argv = ["train", "--experiment", f"{router}-tiny", "--out", str(out), "--no-progress", *DENSE_STEPS]
    for item in ("data.source=synthetic", "data.vocab_size=256", "data.synthetic_samples=0", f"schedule.steps={steps}",
                 "validation.interval=0"):
        argv += ["--set", item]
    assert cli_main(argv) == 0


@pytest.mark.slow
def test_steady_state_is_timed_from_each_routers_trained_checkpoint(tmp_path):
    trained = tmp_path / "trained"
    _train_tiny("dirmoe", trained / "dirmoe")
    out = tmp_path / "eff"
    argv = ["study", "efficiency", "--router", "dirmoe", *FAST, *DENSE_STEPS, "--init-from", str(trained), "--out", str(out)]
    assert cli_main(argv) == 0
    record = load_record(out / "runs" / "dirmoe" / "record.json")
    assert record.efficiency.start_step == 3 and record.efficiency.flops_attention == "causal"
    config = json.loads((out / "runs" / "dirmoe" / "config.json").read_text())["experiment"]
    assert config["checkpoint"]["init_from"] == str((trained / "dirmoe" / "checkpoints").resolve() / "step_0000003")
    assert config["checkpoint"]["init_router_step"] is True
    # The routers ran at the checkpoint's step (3 + i >= dense_steps): sparse dispatch, not every expert.
    num_experts = RunConfig.from_dict(config).model.flavour_config().num_experts
    active = [k for row in read_rows(out / "runs" / "dirmoe") for k in row.routing.get("active_experts") or []]
    assert active and max(active) < num_experts
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timed_from"] == "trained checkpoints" and summary["runs"]["dirmoe"]["start_step"] == 3
    caption = (out / "efficiency.md").read_text()
    assert "Timed from trained checkpoints" in caption and "dirmoe 3" in caption
    assert "causal attention halved" in caption


def test_init_from_refuses_a_run_without_a_checkpoint_of_its_router(capsys, tmp_path):
    empty = tmp_path / "empty"
    (empty / "switch").mkdir(parents=True)
    message = _error(capsys, ["--router", "switch", "--init-from", str(empty), "--out", str(tmp_path / "o")])
    assert "no checkpoint of router 'switch' for run 'switch'" in message and str(empty / "switch") in message
    assert message.count(str(empty / "switch")) == 1, "a folder searched is named once"
    message = _error(capsys, ["--router", "switch", "--init-from", "nope=/x", "--out", str(tmp_path / "o")])
    assert "no run labelled 'nope'" in message
    assert not (tmp_path / "o").exists()


def test_a_variant_with_its_own_micro_batch_trains_the_same_tokens_per_iteration(tmp_path):
    from repro.studies.efficiency import parse

    plan = parse(["--router", "switch", "--variant", "s8=switch,data.micro_batch_size=8", "--variant",
                  "s1=switch,data.micro_batch_size=1", "--vocab-size", "256", "--out", str(tmp_path / "o")], "x")
    data = {r.label: plan.run(r).config().data for r in plan.runs}
    # the tiny recipe: 4 x 2 per iteration; a variant's micro-batch changes the accumulation, not the batch
    assert {k: (d.micro_batch_size, d.global_batch_size, d.num_microbatches(1)) for k, d in data.items()} == {
        "switch": (4, 8, 2), "s8": (8, 8, 1), "s1": (1, 8, 8)}
    with pytest.raises(ReproError, match="not a multiple"):
        parse(["--router", "switch", "--variant", "s3=switch,data.micro_batch_size=3", "--out", str(tmp_path / "p")],
              "x")
