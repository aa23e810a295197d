"""The trainer on CPU (fp32, gloo): every router trains, resumes bit-identically, and DP=2 / EP=2 runs under
torchrun give the one-process losses; plus the run directory's rules, experiments, config overrides, the CLI
and the LR schedule.

Runs are tiny (2 layers, 64-token sequences, a handful of steps) so the file stays well under the CI
budget on two cores.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import routers
from repro.config import MEGATRON_ROUTER, RunConfig, apply_overrides
from repro.errors import ReproError
from repro.experiments import experiment_names, experiment_routers, get_experiment
from repro.records.step_log import read_rows
from repro.training.data import MicroBatchSampler, SyntheticTokens, collate
from repro.training.optim import LRScheduler, WarmupCosineSchedule

REPO = Path(__file__).resolve().parents[1]

# Small and quick: 2 micro-batches of 2 sequences per step (gradient accumulation is exercised), the same
# 4 sequences every step (a falling loss shows after a few steps), no validation, no interim checkpoints.
TINY = [
    "data.source=synthetic",
    "model.seq_length=64",
    "data.micro_batch_size=2",
    "data.global_batch_size=4",
    "data.synthetic_samples=4",
    "schedule.steps=6",
    "optimizer.lr=3e-3",
    "schedule.min_lr=3e-4",
    "schedule.warmup_steps=0",
    "validation.interval=0",
    "checkpoint.interval=0",
]
#: The routers of this package (tests elsewhere register routers of their own, which have experiments too).
BUILTIN = ["auxfree", "dirmoe", "expert_choice", "hash", "lory", "remoe", "sparsemixer", "switch"]


def _experiment(router: str, extra: list[str] = ()) -> RunConfig:
    return apply_overrides(get_experiment(f"{router}-tiny"), TINY + list(extra))


def _read_log(out: Path) -> list[dict]:
    """The log's rows as dicts, with the two headline routing metrics at the top for comparisons."""
    rows = []
    for row in read_rows(out):
        data = dataclasses.asdict(row)
        data["active_experts"] = row.routing.get("active_experts")
        data["simpson"] = row.routing.get("simpson")
        rows.append(data)
    return rows


# ---------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("router", [*BUILTIN, "dense", MEGATRON_ROUTER])
def test_every_router_trains_with_falling_loss(router, tmp_path):
    from repro.training.trainer import train

    exp = _experiment(router)
    summary = train(exp, tmp_path, progress=False)
    records = _read_log(tmp_path)
    assert [r["step"] for r in records] == list(range(1, exp.schedule.steps + 1))
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["lm_loss"])
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tokens_per_s"] > 0
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    if router not in ("dense", MEGATRON_ROUTER):
        # one entry per MoE layer (the tiny flavour has 2), from the adapters' routing metrics
        assert len(records[-1]["active_experts"]) == 2 and len(records[-1]["simpson"]) == 2
        assert all(a >= 0 for a in records[-1]["active_experts"])
        # per-expert loads per layer: a dead expert is visible in the log; they sum to the routed tokens
        loads = records[-1]["routing_per_expert"]["tokens_per_expert"]
        assert len(loads) == 2 and all(len(layer) == 8 for layer in loads)
        tokens = 2 * 64  # one micro-batch: 2 sequences x 64 tokens (the loads are per micro-batch means)
        for layer, active in zip(loads, records[-1]["active_experts"]):
            assert sum(layer) == pytest.approx(active * tokens, rel=1e-5)
    if router == MEGATRON_ROUTER:
        assert records[-1]["aux_losses"]["load_balancing_loss"] > 0  # megatron's tracker, coefficient applied
    # the output directory
    assert (tmp_path / "config.json").is_file() and (tmp_path / "summary.json").is_file()
    assert (tmp_path / "checkpoints" / "step_0000006" / "meta.json").is_file()
    assert summary["steps"] == exp.schedule.steps and summary["final_loss"] == losses[-1]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_microbatches"] == 2 and RunConfig.from_dict(config["experiment"]) == exp
    assert not (tmp_path / "record.json").exists(), "the trainer leaves the run record to its caller"


def test_aux_losses_are_part_of_the_logged_loss(tmp_path):
    from repro.training.trainer import train

    train(_experiment("switch", ["schedule.steps=2"]), tmp_path, progress=False)
    for r in _read_log(tmp_path):
        assert r["aux_losses"]["load_balancing_loss"] > 0
        assert r["loss"] == pytest.approx(r["lm_loss"] + sum(r["aux_losses"].values()), rel=1e-12)
        assert sum(r["aux_losses_per_layer"]["load_balancing_loss"]) == pytest.approx(
            r["aux_losses"]["load_balancing_loss"]
        )


def test_lr_in_log_follows_warmup_cosine(tmp_path):
    from repro.training.trainer import train

    exp = _experiment("dense", ["schedule.steps=5", "schedule.warmup_steps=2", "optimizer.lr=1e-3", "schedule.min_lr=1e-4"])
    train(exp, tmp_path, progress=False)
    schedule = WarmupCosineSchedule(1e-3, 1e-4, 2, 5)
    assert [r["lr"] for r in _read_log(tmp_path)] == [schedule.lr_at(s) for s in range(1, 6)]


def test_switch_adapter_trains_like_megatron_topk_router(tmp_path):
    """Our Switch router behind the adapter and megatron-core's own TopKRouter: same training run."""
    from repro.training.trainer import train

    for router in ("switch", MEGATRON_ROUTER):
        train(_experiment(router, ["schedule.steps=3"]), tmp_path / router, progress=False)
    ours, theirs = _read_log(tmp_path / "switch"), _read_log(tmp_path / MEGATRON_ROUTER)
    for a, b in zip(ours, theirs):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["aux_losses"]["load_balancing_loss"] == pytest.approx(b["aux_losses"]["load_balancing_loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------ resume
def _final_state(out: Path) -> dict:
    files = sorted((out / "checkpoints").glob("step_*/rank_00000.pt"))
    return torch.load(files[-1], map_location="cpu", weights_only=True)  # tensors and plain data only


@pytest.mark.parametrize("router", ["dirmoe", "remoe", "hash", "lory", "auxfree"])
def test_resume_after_kill_is_bit_identical(router, tmp_path):
    from repro.training.trainer import train

    # dirmoe draws noise and runs step schedules, remoe and auxfree adapt buffers after every step, hash holds a
    # table: each is state a resume must carry. Validation every 2 steps checks eval leaves no trace.
    # lory trains dense for steps 0-1 (0.4 of 5): the resume from step 2's checkpoint starts at the switch.
    lory = ["router.options.dense_fraction=0.4"] if router == "lory" else []
    exp = _experiment(
        router,
        ["schedule.steps=5", "checkpoint.interval=2", "validation.interval=2", "data.synthetic_samples=0", *lory],
    )
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(exp, full, progress=False)
    # "killed" after step 3: its last checkpoint is step 2, and step 3 is already in the log.
    out = train(exp, killed, progress=False, stop_after=3)
    assert out["stopped_at"] == 3 and [r["step"] for r in _read_log(killed)] == [1, 2, 3]
    train(None, killed, progress=False, resume=True)

    keys = ("step", "loss", "lm_loss", "grad_norm", "lr", "aux_losses", "routing", "routing_per_expert", "val_loss")
    a = [{k: r.get(k) for k in keys} for r in _read_log(full)]
    b = [{k: r.get(k) for k in keys} for r in _read_log(killed)]
    assert a == b  # exact: fp32 on CPU, same ops in the same order
    sa, sb = _final_state(full), _final_state(killed)
    assert sa["model"].keys() == sb["model"].keys()
    for key in sa["model"]:
        value_a, value_b = sa["model"][key], sb["model"][key]
        if torch.is_tensor(value_a):
            assert torch.equal(value_a, value_b), key  # weights and router buffers (step, coefficients, tables)
    assert any(k.endswith("router.step") for k in sa["model"])
    if router == "auxfree":  # the balancing bias has moved, and the resumed run carried it
        assert any(k.endswith("expert_bias") and sa["model"][k].abs().sum() > 0 for k in sa["model"])


def test_lory_switches_from_dense_to_copies_of_the_ffn_and_trains_on(tmp_path):
    from repro.training.trainer import train

    # 6 steps at dense_fraction 0.5: steps 0-2 dense, the experts copies of the FFN at the switch (step 3).
    exp = _experiment("lory", ["router.options.dense_fraction=0.5", "checkpoint.interval=1"])
    train(exp, tmp_path, progress=False)
    states = {
        int(f.parent.name.split("_")[1]): torch.load(f, map_location="cpu", weights_only=True)["model"]
        for f in (tmp_path / "checkpoints").glob("step_*/rank_00000.pt")
    }
    assert sorted(states) == [1, 2, 3, 4, 5, 6]

    def experts(state, layer):  # fc1 and fc2 of every expert of one layer
        prefix = f"decoder.layers.{layer}.mlp.experts.local_experts."
        return [[state[f"{prefix}{e}.{w}.weight"] for e in range(8)] for w in ("linear_fc1", "linear_fc2")]

    def router_weight(state, layer):
        return next(v for k, v in state.items() if k.startswith(f"decoder.layers.{layer}.") and k.endswith("router.weight"))

    for layer in (0, 1):
        for step in (1, 3):  # in the dense phase and at the switch: E identical copies, trained
            for copies in experts(states[step], layer):
                assert all(torch.equal(w, copies[0]) for w in copies)
        assert not torch.equal(experts(states[3], layer)[0][0], experts(states[1], layer)[0][0])
        # The router is not trained before the switch (no gradient, no decay), and is after it.
        assert torch.equal(router_weight(states[1], layer), router_weight(states[3], layer))
        assert not torch.equal(router_weight(states[3], layer), router_weight(states[6], layer))
        # After the switch the experts part: the segment weights differ, and so do their gradients.
        fc1 = experts(states[6], layer)[0]
        assert not all(torch.equal(w, fc1[0]) for w in fc1)
    records = _read_log(tmp_path)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["active_experts"] is not None and len(records[-1]["active_experts"]) == 2


@pytest.mark.parametrize("router", ["dirmoe", "remoe", "lory"])
def test_metrics_on_some_steps_train_identically_and_log_the_same_values(router, tmp_path):
    from repro.training.trainer import train

    # dirmoe draws noise, remoe's schedule reads its statistic every step, lory's layer checks its segments.
    every, sparse = tmp_path / "every", tmp_path / "sparse"
    train(_experiment(router, ["schedule.steps=7"]), every, progress=False)
    train(_experiment(router, ["schedule.steps=7", "logging.metrics_interval=3"]), sparse, progress=False)
    a, b = read_rows(every), read_rows(sparse)
    assert [r.step for r in b] == list(range(1, 8))
    collected = [r.step for r in b if r.metrics_collected]
    assert collected == [1, 3, 6, 7] and all(r.metrics_collected for r in a)  # first, every 3rd, last
    for ra, rb in zip(a, b):
        assert (ra.loss, ra.lm_loss, ra.grad_norm, ra.aux_losses) == (rb.loss, rb.lm_loss, rb.grad_norm, rb.aux_losses)
        if rb.metrics_collected:
            assert ra.routing and (ra.routing, ra.routing_per_expert) == (rb.routing, rb.routing_per_expert)
            assert ra.router_stats == rb.router_stats
        else:
            assert rb.routing == {} and rb.routing_per_expert == {} and rb.router_stats == {}
    assert (router == "remoe") == bool(b[-1].router_stats)
    sa, sb = _final_state(every), _final_state(sparse)
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"] if torch.is_tensor(sa["model"][k]))


def test_resume_errors_name_the_path(tmp_path):
    from repro.training.trainer import train

    with pytest.raises(ReproError, match=str(tmp_path / "empty") + ": no run to resume"):
        train(None, tmp_path / "empty", resume=True, progress=False)

    exp = _experiment("switch", ["schedule.steps=2"])
    run = tmp_path / "run"
    train(exp, run, progress=False)
    with pytest.raises(ReproError, match="already holds a run"):
        train(exp, run, progress=False)
    (run / "summary.json").unlink()  # not finished: the resume reads the checkpoint
    rank_file = run / "checkpoints" / "step_0000002" / "rank_00000.pt"
    meta = run / "checkpoints" / "step_0000002" / "meta.json"
    good_meta = json.loads(meta.read_text())
    rank_file.write_bytes(b"not a checkpoint")
    with pytest.raises(ReproError, match=str(rank_file)):
        train(None, run, resume=True, progress=False)
    meta.write_text("{")
    # a corrupt meta.json makes the directory unreadable: still an error naming the file
    with pytest.raises(ReproError, match=str(meta)):
        train(None, run, resume=True, progress=False)
    meta.write_text(json.dumps(good_meta))
    with pytest.raises(ReproError, match=r"cannot change what defines the model .*model.num_experts: None -> 4"):
        train(apply_overrides(exp, ["model.num_experts=4"]), run, resume=True, progress=False)
    # a checkpoint of the format before digests and plain-data RNG states is refused in one line
    meta.write_text(json.dumps({k: v for k, v in good_meta.items() if k not in ("format", "sha256", "identity")}))
    with pytest.raises(ReproError, match=rf"{meta}: checkpoint format 1"):
        train(None, run, resume=True, progress=False)


# ----------------------------------------------------------------------------------- run directory
def test_a_fresh_run_needs_a_new_or_empty_directory(tmp_path):
    from repro.training.trainer import train

    exp = _experiment("dense", ["schedule.steps=1"])
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ReproError, match="is not empty .*notes.txt"):
        train(exp, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ReproError, match="cannot use as a run directory"):
        train(exp, tmp_path / "file" / "run", progress=False)


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    from repro.cli import main

    args = ["train", "--experiment", "switch-tiny", "--out", str(tmp_path), "--no-progress"]
    for item in TINY + ["schedule.steps=2"]:
        args += ["--set", item]
    assert main(args) == 0
    record = json.loads((tmp_path / "record.json").read_text())
    record["lm_eval"] = {"results": {"piqa": {"acc,none": 0.5}}}  # as `repro eval` would have added
    (tmp_path / "record.json").write_text(json.dumps(record))
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert main(["train", "--out", str(tmp_path), "--resume", "--no-progress"]) == 0
    assert "finished at step 2; nothing to do" in capsys.readouterr().err
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    assert json.loads((tmp_path / "record.json").read_text())["lm_eval"]["results"]["piqa"]["acc,none"] == 0.5


def test_resume_keeps_the_runs_own_settings_and_reopens_a_finished_run_only_when_asked(tmp_path, capsys):
    """The original command plus --resume resumes (the experiment's defaults are not applied again); a finished
    run is not reopened by a --set, only by --extend, and then its summary and record are written anew."""
    from repro.cli import main

    run = tmp_path / "run"
    args = ["train", "--experiment", "switch-tiny", "--out", str(run), "--no-progress"]
    for item in TINY + ["schedule.steps=2"]:
        args += ["--set", item]
    assert main(args + ["--stop-after", "1"]) == 0  # stopped after step 1, before the end
    assert f"switch-tiny: stopped after step 1 (--stop-after), without a final checkpoint; resume with: python -m " \
        f"repro train --out {run} --resume" in capsys.readouterr().err
    # The original command with --resume: its --set repeat the run's own values, so nothing changes.
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "resumed with" not in err and "cannot change" not in err
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # A finished run is left alone by --resume, and a --set does not reopen it.
    assert main(["train", "--out", str(run), "--resume", "--set", "schedule.steps=4"]) == 2
    assert re.search(r"finished at step 2; it is not reopened to change schedule.steps .*--extend", capsys.readouterr().err)
    assert main(["train", "--experiment", "dense-tiny", "--out", str(run), "--resume"]) == 2
    assert "holds a run of experiment 'switch-tiny', not 'dense-tiny'" in capsys.readouterr().err
    old_record = json.loads((run / "record.json").read_text())
    assert main(["train", "--out", str(run), "--resume", "--extend", "--set", "schedule.steps=4", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"{run}: resumed with schedule.steps: 2 -> 4" in err
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    record = json.loads((run / "record.json").read_text())
    assert len(record["loss_curve"]) > len(old_record["loss_curve"])  # the record describes the longer run
    assert main(["train", "--out", str(run), "--resume", "--extend"]) == 2
    assert "--extend needs --set schedule.steps above the 4 steps done" in capsys.readouterr().err


def test_seeds_of_one_experiment_trained_by_train_form_a_seed_band(tmp_path, capsys):
    """Three seeds of one experiment through `train` get distinct run ids (the experiment's own seed keeps the
    plain name), so `check` can read them together as a band."""
    from repro.cli import main
    from repro.records.store import load_records

    base = ["train", "--experiment", "dense-tiny", "--no-progress"]
    for item in TINY + ["schedule.steps=2"]:
        base += ["--set", item]
    own = get_experiment("dense-tiny").seed
    for seed in (own, own + 1, own + 2):
        assert main(base + ["--out", str(tmp_path / "seeds" / str(seed)), "--set", f"seed={seed}"]) == 0
    ids = sorted(r.run_id for r in load_records([tmp_path / "seeds"]))
    assert ids == ["dense-tiny", f"dense-tiny-seed{own + 1}", f"dense-tiny-seed{own + 2}"]
    assert main(base + ["--out", str(tmp_path / "new"), "--set", f"seed={own + 3}"]) == 0
    capsys.readouterr()
    assert main(["report", "check", str(tmp_path / "new"), "--against", str(tmp_path / "seeds")]) in (0, 1)
    assert capsys.readouterr().out.startswith("Against 3 seeds: K = 1 number compared")  # the final loss


def test_init_from_a_checkpoint_of_another_vocabulary_says_so(tmp_path):
    from repro.training.trainer import train

    source = tmp_path / "source"
    train(_experiment("switch", ["schedule.steps=1", "checkpoint.interval=1", "data.vocab_size=300"]), source,
          progress=False)
    other = _experiment("switch", ["schedule.steps=1", "data.vocab_size=500", f"checkpoint.init_from={source}"])
    with pytest.raises(ReproError, match=r"a checkpoint of another vocabulary \(384 embedding rows, padded; this "
                                         r"model has 512\)"):
        train(other, tmp_path / "new", progress=False)
    same = _experiment("switch", ["schedule.steps=1", "data.vocab_size=300", f"checkpoint.init_from={source}"])
    train(same, tmp_path / "same", progress=False)  # the same vocabulary starts from it


def test_resume_without_a_complete_checkpoint_starts_again_from_step_0(tmp_path, capsys):
    from repro.training.trainer import train

    exp = _experiment("switch", ["schedule.steps=3"])
    train(exp, tmp_path / "full", progress=False)
    killed = tmp_path / "killed"
    assert train(exp, killed, progress=False, stop_after=2)["stopped_at"] == 2
    assert not (killed / "checkpoints").exists() or not any((killed / "checkpoints").glob("step_*"))
    (killed / "checkpoints").mkdir(exist_ok=True)
    (killed / "checkpoints" / ".step_0000003.tmp").mkdir()  # as a kill while writing the first checkpoint leaves
    with pytest.raises(ReproError, match="already holds a run; pass --resume .*from step 0"):
        train(exp, killed, progress=False)
    train(None, killed, progress=False, resume=True)
    assert "no complete checkpoint yet; training again from step 0" in capsys.readouterr().err
    full, again = _read_log(tmp_path / "full"), _read_log(killed)
    assert [r["step"] for r in again] == [1, 2, 3]
    assert [r["loss"] for r in again] == [r["loss"] for r in full]


def test_the_backend_is_a_config_choice_recorded_with_the_run(tmp_path):
    from repro.cli import main

    args = ["train", "--experiment", "remoe-tiny", "--out", str(tmp_path / "torch"), "--no-progress"]
    for item in TINY + ["schedule.steps=2", "model.backend=torch"]:
        args += ["--set", item]
    assert main(args) == 0
    assert json.loads((tmp_path / "torch" / "config.json").read_text())["backend"] == "torch"
    record = json.loads((tmp_path / "torch" / "record.json").read_text())
    assert record["efficiency"]["backend"] == "torch"
    # the same run on the local backend gives the same losses (the torch modules match megatron's)
    from repro.training.trainer import train

    train(_experiment("remoe", ["schedule.steps=2"]), tmp_path / "local", progress=False)
    a, b = _read_log(tmp_path / "torch"), _read_log(tmp_path / "local")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=5e-5)
    # a resume must build the backend the run started with
    (tmp_path / "torch" / "summary.json").unlink()
    changed = apply_overrides(_experiment("remoe", ["schedule.steps=2", "model.backend=torch"]), ["model.backend=local"])
    with pytest.raises(ReproError, match="the run trained with backend 'torch', this machine builds 'local'"):
        train(changed, tmp_path / "torch", resume=True, progress=False)


def test_a_run_directory_is_locked_while_a_run_uses_it(tmp_path):
    from repro.training.run_dir import RunPaths, run_lock
    from repro.training.trainer import train

    with run_lock(RunPaths(tmp_path)):
        with pytest.raises(ReproError, match=f"{tmp_path}: another run is using this directory \\(process {os.getpid()}\\)"):
            train(_experiment("dense", ["schedule.steps=1"]), tmp_path, progress=False)
    assert not (tmp_path / "log.jsonl").exists()
    train(_experiment("dense", ["schedule.steps=1"]), tmp_path, progress=False)  # released on exit


def test_a_non_finite_loss_stops_with_a_way_to_resume(tmp_path, monkeypatch):
    from repro.training import trainer as trainer_module

    exp = _experiment("dense", ["schedule.steps=4", "checkpoint.interval=2"])
    real_step = trainer_module.Trainer.train_step

    def step_with_nan(self):
        row = real_step(self)
        if row.step == 3:
            raise trainer_module.NonFiniteLoss(f"experiment '{self.config.name}': loss is nan at step 3")
        return row

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step_with_nan)
    with pytest.raises(ReproError, match="loss is nan at step 3; .* resume from its checkpoint of step 2 with other settings"):
        trainer_module.train(exp, tmp_path, progress=False)
    monkeypatch.setattr(trainer_module.Trainer, "train_step", real_step)
    changed = apply_overrides(exp, ["optimizer.lr=1e-3"])
    summary = trainer_module.train(changed, tmp_path, resume=True, progress=False)
    assert summary["steps"] == 4
    assert [r["step"] for r in _read_log(tmp_path)] == [1, 2, 3, 4]
    history = json.loads((tmp_path / "resume_changes.json").read_text())
    assert history == [{"from_step": 2, "changes": {"optimizer.lr": "0.003 -> 0.001"}}]
    assert RunConfig.from_dict(json.loads((tmp_path / "config.json").read_text())["experiment"]) == changed


# ------------------------------------------------------------------------------------- distributed
def _torchrun(args: list[str], timeout: int = 600) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "repro", "train"]
    proc = subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.distributed
def test_two_processes_match_one(tmp_path):
    """Two processes with EP=2 reproduce ReMoE's one-process losses (its statistic is averaged over the ranks,
    which megatron makes data-parallel ranks too: it carves EP out of DP): the alltoall dispatcher, experts
    sharded, expert gradients reduced over the expert-DP group only. DP=2 with replicated experts matches one
    process in tests/test_preemption.py (two ranks, the aux-loss-free router's counts summed over them)."""
    from repro.training.trainer import train

    sets = TINY + ["schedule.steps=3", "data.global_batch_size=8", "data.synthetic_samples=0"]
    exp = apply_overrides(get_experiment("remoe-tiny"), sets)
    train(exp, tmp_path / "one", progress=False)
    args = ["--experiment", "remoe-tiny", "--out", str(tmp_path / "two"), "--no-progress"]
    for item in sets + ["parallel.ep=2"]:
        args += ["--set", item]
    _torchrun(args)

    one, two = _read_log(tmp_path / "one"), _read_log(tmp_path / "two")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in ("loss", "lm_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a["step"])
        assert b["active_experts"] == pytest.approx(a["active_experts"], rel=1e-5)
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert config["layout"]["world_size"] == 2 and config["num_microbatches"] == 2
    assert config["layout"]["ep"] == 2 and config["layout"]["dp"] == 2
    assert config["parameters"]["expert_local"] * 2 == config["parameters"]["expert_total"]
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "step_0000003").iterdir()) == [
        "meta.json", "rank_00000.pt", "rank_00001.pt"]


# ------------------------------------------------------------------------------- experiments, CLI
def test_experiments_derive_from_the_router_registry():
    names = set(experiment_names())
    assert set(experiment_routers()) == {*routers.available_routers(), MEGATRON_ROUTER, "dense"}
    for router in experiment_routers():
        assert {f"{router}-tiny", f"{router}-185m"} <= names
    for name in names:
        config = get_experiment(name)
        # one word for a model size: an experiment's suffix is its model's flavour (dense: the flavour's twin)
        assert config.name == name and config.model.flavour.removesuffix("-dense") == name.rpartition("-")[2]
    # a router's declared recipe overrides, applied at their flavour only
    lory = get_experiment("lory-tiny")
    assert lory.router.options == {"segment_len": 32} and lory.data.similarity_batching
    assert get_experiment("lory-185m").router.options == {} and get_experiment("lory-185m").data.similarity_batching
    assert not get_experiment("switch-tiny").data.similarity_batching
    # the 185M runs follow ReMoE's baselines: id mod E hashing, softmax before the top-k at every k
    assert get_experiment("hash-185m").router.options == {"hash_type": "mod"}
    assert get_experiment("hash-tiny").router.options == {}
    assert get_experiment("switch-185m").router.options == {"pre_softmax": True}
    # a router's declared variants have experiments of their own (the suite's, labelled as such)
    centered = get_experiment("dirmoe+centered-tiny")
    assert centered.name == "dirmoe+centered-tiny" and centered.router.options == {"recon_target": "centered"}
    assert "dirmoe+centered" in experiment_routers(variants=True) and "dirmoe+centered" not in experiment_routers()
    assert get_experiment("dirmoe+centered-185m").optimizer.lr == get_experiment("dirmoe-185m").optimizer.lr
    with pytest.raises(ReproError, match="unknown experiment 'dirmoe\\+nope-tiny'"):
        get_experiment("dirmoe+nope-tiny")


def test_paper_settings():
    remoe, dirmoe = get_experiment("remoe-185m"), get_experiment("dirmoe-185m")
    for exp in (remoe, dirmoe, get_experiment("dense-185m")):
        assert exp.data.global_batch_size == 512 and exp.seq_length == 1024 and exp.schedule.steps == 60_000
        assert exp.schedule.num_warmup_steps == 600 and exp.optimizer.weight_decay == 0.01
        assert exp.optimizer.clip_grad == 1.0 and exp.model.precision == "bf16"
    assert remoe.optimizer.lr == 5e-4 and remoe.schedule.min_lr == 5e-5  # ReMoE's scripts
    # DirMoE's hyper-parameter table: learning rate 1e-4, min lr 0.1 x base, Adam betas (0.9, 0.995)
    assert dirmoe.optimizer.lr == 1e-4 and dirmoe.schedule.min_lr == pytest.approx(0.1 * dirmoe.optimizer.lr)
    assert (dirmoe.optimizer.beta1, dirmoe.optimizer.beta2) == (0.9, 0.995)
    # DirMoE's temperature/prior schedules span the run
    assert dirmoe.router_options()["schedule_steps"] == 60_000
    assert apply_overrides(dirmoe, ["schedule.steps=100"]).router_options()["schedule_steps"] == 100


def test_overrides_parse_to_field_types():
    exp = apply_overrides(
        get_experiment("dirmoe-tiny"),
        ["schedule.steps=12", "optimizer.lr=1e-3", "model.seq_length=null", "optimizer.distributed=false",
         "router.options.kl_weight=1", "router.options.dispatch=topk"],
    )
    assert exp.schedule.steps == 12 and exp.optimizer.lr == 1e-3 and exp.model.seq_length is None
    assert exp.optimizer.distributed is False
    assert exp.router.options == {"kl_weight": 1.0, "dispatch": "topk"}
    assert isinstance(exp.router.options["kl_weight"], float)  # typed by DirMoEConfig.kl_weight
    # a new router drops the old router's options; options are checked against the new router
    switched = apply_overrides(exp, ["router.name=switch", "router.options.aux_loss_coeff=0.05"])
    assert switched.router.name == "switch" and switched.router.options == {"aux_loss_coeff": 0.05}
    # round trip through config.json
    assert RunConfig.from_dict(json.loads(json.dumps(exp.to_dict()))) == exp


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("nope=1", "Key 'nope' not in 'RunConfig'; valid keys: .*schedule.steps"),
        ("schedule.stpes=1", "Did you mean: 'steps'"),
        ("schedule.steps=abc", "schedule.steps: Value 'abc' of type 'str' could not be converted to Integer"),
        ("optimizer.lr=fast", "could not be converted to Float"),
        ("optimizer.lr=nan", "optimizer.lr must be a finite number, got nan"),
        ("optimizer.clip_grad=nan", "optimizer.clip_grad must be a finite number"),
        ("schedule.min_lr=inf", "schedule.min_lr must be a finite number"),
        ("steps", "key=value"),
        ("router.options.nope=1", "unknown option.* nope for router 'dirmoe'; valid: .*kl_weight"),
        ("router.options.dispatch=bogus", "dispatch"),
        ("router.options.kl_weight=heavy", "router.options.kl_weight: .*could not be converted to Float"),
        ("data.global_batch_size=7", "multiple of data.micro_batch_size"),
        ("model.precision=fp16", "expected one of \\['auto', 'fp32', 'bf16'\\]"),
        ("router.name=bogus", "unknown router 'bogus'"),
    ],
)
def test_bad_overrides_are_one_line_errors(assignment, message):
    with pytest.raises(ReproError, match=message) as info:
        apply_overrides(get_experiment("dirmoe-tiny"), [assignment])
    assert "\n" not in str(info.value)


def test_a_run_prints_its_own_lines_only(tmp_path):
    """megatron-core's notices that do not apply here (Apex absent, the deprecated 'full' CUDA-graph scope, Lory's
    MoE layer an MLP type megatron does not know) stay off a run's output, in a fresh process as a user runs it."""
    cmd = [sys.executable, "-m", "repro", "train", "--experiment", "lory-tiny", "--out", str(tmp_path / "run"),
           "--no-progress"]
    for item in TINY + ["schedule.steps=2"]:
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    assert done.stderr.splitlines() == [l for l in done.stderr.splitlines() if l.startswith("lory-tiny: 2 steps")]
    # The run records every router option's value, its defaults included (Lory's 5% dense start).
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["router_options_resolved"]
    assert resolved["dense_fraction"] == 0.05 and resolved["segment_len"] == 32 and resolved["schedule_steps"] == 2


@pytest.mark.parametrize("command", ["train", "study mini", "study ablation", "study efficiency", "study", "report check", "eval"])
def test_help_answers_without_loading_torch(command):
    """``--help`` parses before any heavy import: no torch, no megatron-core (seconds on a loaded machine)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['repro', *{command.split()!r}, '--help']\n"
        "try:\n    runpy.run_module('repro', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and done.stdout.strip().endswith("[]"), done.stdout[-500:]


def test_the_installed_console_script_names_itself(capsys):
    """``pip install`` puts ``dirmoe-bench`` on the PATH: the same CLI, its usage and errors under that name."""
    script = Path(sys.executable).with_name("dirmoe-bench")
    assert script.is_file(), "the project's console script (pyproject [project.scripts]) is not installed"
    done = subprocess.run([str(script), "trian"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown command 'trian'; did you mean 'train'?" in done.stderr
    usage = subprocess.run([str(script)], capture_output=True, text=True, timeout=120).stdout
    assert usage.startswith("usage: dirmoe-bench <command> [options]")


def test_seven_commands_and_one_line_for_a_moved_or_mistyped_one(capsys):
    """At most seven top-level commands; an earlier command name says what it is now, a mistyped subcommand
    gets a 'did you mean', and `eval` with options is the evaluation itself."""
    from repro import cli

    assert len(cli.COMMANDS) <= 7
    assert cli.main(["mini"]) == 2 and "error: 'mini' is now 'study mini'" in capsys.readouterr().err
    assert cli.main(["report", "tabels"]) == 2
    assert "unknown 'report' subcommand 'tabels'; did you mean 'tables'?" in capsys.readouterr().err
    assert cli.resolve(["eval", "--checkpoint", "x"])[1:] == ("eval run", ["--checkpoint", "x"])
    assert cli.resolve(["report", "check", "a"])[1:] == ("report check", ["a"])
    assert cli.main(["study", "efficiency", "--profile"]) == 2
    assert "python -m repro study router-costs" in capsys.readouterr().err
    assert cli.main(["report"]) == 0 and "report writeup" in capsys.readouterr().out
    # the command launch prints for torchrun is checked before it is printed
    assert cli.main(["launch", "--", "mini", "--seeds", "2"]) == 2
    assert "error: 'mini' is now 'study mini'" in capsys.readouterr().err


def test_cli_errors_and_list(tmp_path, capsys):
    from repro.cli import main

    assert main(["train", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "dirmoe-tiny" in listed and "switch-185m" in listed
    assert main(["train", "--experiment", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown experiment 'nope'; valid:") and "\n" not in err
    # A near miss names the likely name, for experiments, routers and studies alike.
    assert main(["train", "--experiment", "dirmoe-tinny", "--out", str(tmp_path)]) == 2
    assert "unknown experiment 'dirmoe-tinny'; did you mean 'dirmoe-tiny'? valid:" in capsys.readouterr().err
    assert main(["train", "--experiment", "switch-tiny", "--set", "router.name=dirmo", "--show"]) == 2
    assert "unknown router 'dirmo'; did you mean 'dirmoe'?" in capsys.readouterr().err
    # Every router option's value, defaults included, is shown (and recorded in config.json).
    assert main(["train", "--experiment", "auxfree-tiny", "--show"]) == 0
    assert "# router options in effect (router.options over auxfree's defaults):\n#   bias_update_rate: 0.001" in \
        capsys.readouterr().out
    assert main(["train", "--experiment", "lory-tiny", "--set", "router.options.segment_len=512", "--show"]) == 2
    assert "segment_len=512 is above the sequence length 128" in capsys.readouterr().err
    assert main(["study", "minii"]) == 2
    assert "unknown study 'minii'; did you mean 'mini'? valid:" in capsys.readouterr().err
    assert main(["train", "--experiment", "switch-tiny", "--set", "bogus=1", "--out", str(tmp_path)]) == 2
    assert "Key 'bogus' not in 'RunConfig'" in capsys.readouterr().err
    assert main(["train", "--experiment", "switch-tiny", "--show"]) == 0
    assert "schedule:\n  steps: 200" in capsys.readouterr().out
    assert main(["train", "--list-routers"]) == 0
    assert set(capsys.readouterr().out.split()) == set(experiment_routers())
    assert main(["train", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert str(tmp_path / "none") in capsys.readouterr().err


def test_cli_trains(tmp_path, capsys):
    from repro.cli import main

    args = ["train", "--experiment", "hash-tiny", "--out", str(tmp_path), "--no-progress"]
    for item in TINY + ["schedule.steps=2"]:
        args += ["--set", item]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["experiment"] == "hash-tiny" and summary["steps"] == 2
    record = json.loads((tmp_path / "record.json").read_text())  # the command writes the run record
    assert record["run_id"] == "hash-tiny" and len(record["loss_curve"]) == 2


# ----------------------------------------------------------------------------------- LR, data
def test_lr_schedule_warmup_cosine_floor():
    s = WarmupCosineSchedule(peak_lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [s.lr_at(i) for i in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]  # linear warmup to the peak
    assert s.lr_at(9) == pytest.approx(0.55)  # half-way through the cosine: (peak + min) / 2
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(1000) == pytest.approx(0.1)  # the floor
    values = [s.lr_at(i) for i in range(4, 15)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay
    no_warmup = WarmupCosineSchedule(1.0, 0.0, 0, 10)
    assert no_warmup.lr_at(1) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.1)))

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    sched = LRScheduler(opt, s)
    assert sched.apply() == 0.25 and opt.param_groups[0]["lr"] == 0.25
    sched.step()
    state = sched.state_dict()
    other = LRScheduler(opt, s)
    other.load_state_dict(state)
    assert other.apply() == 0.5
    # megatron's param groups carry lr_mult / wd_mult and get lr and weight decay from the scheduler
    groups = torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr_mult": 0.5, "wd_mult": 0.0},
         {"params": [torch.nn.Parameter(torch.zeros(1))], "lr_mult": 1.0, "wd_mult": 1.0}], lr=0.0)
    LRScheduler(groups, s, weight_decay=0.01).apply()
    assert [(g["lr"], g["weight_decay"]) for g in groups.param_groups] == [(0.125, 0.0), (0.25, 0.01)]


def test_synthetic_data_is_deterministic_and_dp_slices_cover_the_batch():
    data = SyntheticTokens(vocab_size=64, seq_length=16, seed=3)
    a, b = data[5], SyntheticTokens(vocab_size=64, seq_length=16, seed=3)[5]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["labels"][:-1], a["tokens"][1:])
    assert not torch.equal(data[5]["tokens"], SyntheticTokens(64, 16, seed=4)[5]["tokens"])
    one = MicroBatchSampler(2, 0, 1, num_microbatches=4)
    ranks = [MicroBatchSampler(2, r, 2, num_microbatches=2) for r in range(2)]
    single = sorted(list(one.indices(8, j)) for j in range(4))
    split = sorted(list(s.indices(8, j)) for s in ranks for j in range(2))
    assert single == split  # the same micro-batches, spread over the ranks
    batch = collate(data, one.indices(0, 0))
    assert batch["tokens"].shape == (2, 16) and batch["loss_mask"].dtype == torch.float32


def _loop_sample(data: SyntheticTokens, index: int) -> np.ndarray:
    """The per-token loop the vectorised generator replaced, kept as its reference."""
    table = np.random.default_rng([data.seed, 0x5EED]).integers(0, data.vocab_size, size=(data.vocab_size, data.successors))
    rng = np.random.default_rng([data.seed, data.split + 1, index])
    n = data.seq_length + 1
    pick = rng.integers(0, data.successors, size=n)
    noisy = rng.random(n) < data.noise
    uniform = rng.integers(0, data.vocab_size, size=n)
    seq = np.empty(n, dtype=np.int64)
    seq[0] = uniform[0]
    for t in range(1, n):
        seq[t] = uniform[t] if noisy[t] else table[seq[t - 1], pick[t]]
    return seq


@pytest.mark.parametrize(
    "data",
    [
        SyntheticTokens(vocab_size=50257, seq_length=256, seed=1),
        SyntheticTokens(vocab_size=100, seq_length=64, seed=3, split=1),
        SyntheticTokens(vocab_size=7, seq_length=9, noise=0.0),  # one run per sample
        SyntheticTokens(vocab_size=30, seq_length=20, noise=1.0, num_samples=5),  # every token noisy; wraps
    ],
)
def test_vectorised_synthetic_tokens_equal_the_per_token_loop(data):
    indices = [*range(24), 1000, 123456789]
    batch = collate(data, indices)
    for row, index in enumerate(indices):
        reference = _loop_sample(data, index % data.num_samples if data.num_samples else index)
        assert np.array_equal(batch["tokens"][row].numpy(), reference[:-1]), index
        assert np.array_equal(batch["labels"][row].numpy(), reference[1:]), index
        assert all(torch.equal(batch[k][row], v) for k, v in data[index].items())
    assert batch["position_ids"].shape == batch["loss_mask"].shape == (len(indices), data.seq_length)


def test_training_leaves_megatron_aux_loss_scale_as_it_was(tmp_path):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from repro.training.trainer import train

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    before = before.clone() if before is not None else None
    train(_experiment("switch", ["schedule.steps=1"]), tmp_path, progress=False)  # sets 1 / 2 micro-batches inside
    after = MoEAuxLossAutoScaler.main_loss_backward_scale
    assert (after is None and before is None) or torch.equal(after, before)


def test_checkpoint_expert_renumbering_across_ep_layouts():
    from repro.training.checkpoint import _to_global_key, global_model_state

    key = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    assert _to_global_key(key, ep_rank=1, num_local=4) == key.replace("local_experts.2.", "local_experts.6.")
    assert _to_global_key("decoder.layers.0.mlp.router.weight", 1, 4) == "decoder.layers.0.mlp.router.weight"
    ranks = [
        {"ep_rank": r, "model": {f"l.mlp.experts.local_experts.{i}.w": torch.tensor([4.0 * r + i]) for i in range(4)}}
        for r in range(2)
    ]
    merged = global_model_state(ranks)
    assert {k: float(v) for k, v in merged.items()} == {f"l.mlp.experts.local_experts.{g}.w": float(g) for g in range(8)}
