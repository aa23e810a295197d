"""The training loop on CPU (fp32, gloo): every router trains, resumes bit-identically, and DP=2 / EP=2
runs under torchrun give the one-process losses; plus experiments, overrides, the CLI and the LR schedule.

Runs are tiny (2 layers, 64-token sequences, a handful of steps) so the file stays well under the CI
budget on two cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repro.errors import ReproError
from repro.training.experiments import (
    EXPERIMENTS,
    MEGATRON_ROUTER,
    ROUTERS,
    apply_overrides,
    experiment_names,
    get_experiment,
)
from repro.training.lr_schedule import LRScheduler, WarmupCosineSchedule
from repro.training.synthetic import MicroBatchSampler, SyntheticTokens, collate

REPO = Path(__file__).resolve().parents[1]

# Small and quick: 2 micro-batches of 2 sequences per step (gradient accumulation is exercised), the same
# 4 sequences every step (a falling loss shows after a few steps), no validation, no interim checkpoints.
TINY = [
    "data=synthetic",
    "seq_length=64",
    "micro_batch_size=2",
    "global_batch_size=4",
    "synthetic_samples=4",
    "steps=6",
    "lr=3e-3",
    "min_lr=3e-4",
    "warmup_steps=0",
    "eval_interval=0",
    "checkpoint_interval=0",
]


def _experiment(router: str, extra: list[str] = ()):
    return apply_overrides(get_experiment(f"{router}-tiny"), TINY + list(extra))


def _all_router_names() -> list[str]:
    """Every router that has a ``<router>-tiny`` experiment (routers registered by other tests have none)."""
    from repro.training.experiments import ROUTERS

    return [*ROUTERS, "dense", MEGATRON_ROUTER]


def _read_log(out: Path) -> list[dict]:
    from repro.training.loop import read_log

    return read_log(out)


# ---------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("router", _all_router_names())
def test_every_router_trains_with_falling_loss(router, tmp_path):
    from repro.training.loop import LOG_FIELDS, train

    exp = _experiment(router)
    summary = train(exp, tmp_path, progress=False)
    records = _read_log(tmp_path)
    assert [r["step"] for r in records] == list(range(1, exp.steps + 1))
    for r in records:
        assert set(LOG_FIELDS) - {"val_loss"} <= set(r)
        assert math.isfinite(r["loss"]) and math.isfinite(r["lm_loss"])
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tokens_per_s"] > 0
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    if router not in ("dense", MEGATRON_ROUTER):
        # one entry per MoE layer (the tiny flavour has 2), from the adapters' routing metrics
        assert len(records[-1]["active_experts"]) == 2 and len(records[-1]["simpson"]) == 2
        assert all(a >= 0 for a in records[-1]["active_experts"])
    if router == MEGATRON_ROUTER:
        assert records[-1]["aux_losses"]["load_balancing_loss"] > 0  # megatron's tracker, coefficient applied
    # the output directory
    assert (tmp_path / "config.json").is_file() and (tmp_path / "summary.json").is_file()
    assert (tmp_path / "checkpoints" / "step_0000006" / "meta.json").is_file()
    assert summary["steps"] == exp.steps and summary["final_loss"] == losses[-1]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_microbatches"] == 2 and config["experiment"]["name"] == exp.name


def test_aux_losses_are_part_of_the_logged_loss(tmp_path):
    from repro.training.loop import train

    train(_experiment("switch", ["steps=2"]), tmp_path, progress=False)
    for r in _read_log(tmp_path):
        assert r["aux_losses"]["load_balancing_loss"] > 0
        assert r["loss"] == pytest.approx(r["lm_loss"] + sum(r["aux_losses"].values()), rel=1e-12)
        assert sum(r["aux_losses_per_layer"]["load_balancing_loss"]) == pytest.approx(
            r["aux_losses"]["load_balancing_loss"]
        )


def test_lr_in_log_follows_warmup_cosine(tmp_path):
    from repro.training.loop import train

    exp = _experiment("dense", ["steps=5", "warmup_steps=2", "lr=1e-3", "min_lr=1e-4"])
    train(exp, tmp_path, progress=False)
    schedule = WarmupCosineSchedule(1e-3, 1e-4, 2, 5)
    assert [r["lr"] for r in _read_log(tmp_path)] == [schedule.lr_at(s) for s in range(1, 6)]


def test_switch_adapter_trains_like_megatron_topk_router(tmp_path):
    """Our Switch router behind the adapter and megatron-core's own TopKRouter: same training run."""
    from repro.training.loop import train

    for router in ("switch", MEGATRON_ROUTER):
        train(_experiment(router, ["steps=3"]), tmp_path / router, progress=False)
    ours, theirs = _read_log(tmp_path / "switch"), _read_log(tmp_path / MEGATRON_ROUTER)
    for a, b in zip(ours, theirs):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["aux_losses"]["load_balancing_loss"] == pytest.approx(b["aux_losses"]["load_balancing_loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------ resume
def _final_state(out: Path) -> dict:
    files = sorted((out / "checkpoints").glob("step_*/rank_00000.pt"))
    return torch.load(files[-1], map_location="cpu", weights_only=True)  # tensors and plain data only


@pytest.mark.parametrize("router", ["dirmoe", "remoe", "hash"])
def test_resume_after_kill_is_bit_identical(router, tmp_path):
    from repro.training.loop import train

    # dirmoe draws noise and runs step schedules, remoe adapts a buffer after every step, hash holds a
    # table: each is state a resume must carry. Validation every 2 steps checks eval leaves no trace.
    exp = _experiment(router, ["steps=5", "checkpoint_interval=2", "eval_interval=2", "synthetic_samples=0"])
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(exp, full, progress=False)
    # "killed" after step 3: its last checkpoint is step 2, and step 3 is already in the log.
    out = train(exp, killed, progress=False, stop_after=3)
    assert out["stopped_at"] == 3 and [r["step"] for r in _read_log(killed)] == [1, 2, 3]
    train(None, killed, progress=False, resume=True)

    keys = ("step", "loss", "lm_loss", "grad_norm", "lr", "aux_losses", "active_experts", "simpson", "val_loss")
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


def test_resume_errors_name_the_path(tmp_path):
    from repro.training.loop import train

    with pytest.raises(ReproError, match=str(tmp_path / "empty" / "checkpoints")):
        train(None, tmp_path / "empty", resume=True, progress=False)

    exp = _experiment("switch", ["steps=2"])
    run = tmp_path / "run"
    train(exp, run, progress=False)
    with pytest.raises(ReproError, match="already holds a run"):
        train(exp, run, progress=False)
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
    with pytest.raises(ReproError, match="different config"):
        from repro.training.checkpoint import find_latest_checkpoint

        meta.write_text(json.dumps(good_meta))
        assert find_latest_checkpoint(run / "checkpoints") is not None
        train(apply_overrides(exp, ["lr=1e-2"]), run, resume=True, progress=False)
    # a checkpoint of the format before digests and plain-data RNG states is refused in one line
    meta.write_text(json.dumps({k: v for k, v in good_meta.items() if k not in ("format", "sha256", "identity")}))
    with pytest.raises(ReproError, match=rf"{meta}: checkpoint format 1"):
        train(None, run, resume=True, progress=False)


# ------------------------------------------------------------------------------------- distributed
def _torchrun(args: list[str], timeout: int = 240) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "repro", "train"]
    proc = subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "router, layout",
    [("remoe", "ep=1"), ("switch", "ep=2")],
    ids=["dp2-remoe", "ep2-switch"],
)
def test_two_processes_match_one(router, layout, tmp_path):
    """DP=2 (ReMoE: its statistic is averaged over ranks) and EP=2 (alltoall dispatcher, experts sharded,
    expert gradients reduced over the expert-DP group only) reproduce the one-process losses."""
    from repro.training.loop import train

    sets = TINY + ["steps=3", "global_batch_size=8", "synthetic_samples=0"]
    exp = apply_overrides(get_experiment(f"{router}-tiny"), sets)
    train(exp, tmp_path / "one", progress=False)
    args = ["--experiment", f"{router}-tiny", "--out", str(tmp_path / "two"), "--no-progress"]
    for item in sets + [layout]:
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
    if layout == "ep=2":
        assert config["layout"]["ep"] == 2
        assert config["parameters"]["expert_local"] * 2 == config["parameters"]["expert_total"]
        assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "step_0000003").iterdir()) == [
            "meta.json", "rank_00000.pt", "rank_00001.pt"]


# ------------------------------------------------------------------------------- experiments, CLI
def test_registry_has_every_router_at_both_scales():
    names = set(experiment_names())
    for router in ROUTERS + ("dense",):
        assert {f"{router}-tiny", f"{router}-185m"} <= names
    assert {"megatron-tiny", "megatron-185m"} <= names
    for name in names:
        assert EXPERIMENTS[name].name == name


def test_paper_settings():
    remoe, dirmoe = get_experiment("remoe-185m"), get_experiment("dirmoe-185m")
    for exp in (remoe, dirmoe, get_experiment("dense-185m")):
        assert exp.global_batch_size == 512 and exp.seq_length == 1024 and exp.steps == 60_000
        assert exp.lr == 5e-4 and exp.num_warmup_steps == 600 and exp.weight_decay == 0.01
        assert exp.clip_grad == 1.0 and exp.precision == "bf16"
    assert remoe.min_lr == 5e-5 and dirmoe.min_lr == 1e-4
    assert (dirmoe.adam_beta1, dirmoe.adam_beta2) == (0.9, 0.995)
    # DirMoE's temperature/prior schedules span the run
    assert dirmoe.build_router_options()["schedule_steps"] == 60_000
    assert apply_overrides(dirmoe, ["steps=100"]).build_router_options()["schedule_steps"] == 100


def test_overrides_parse_to_field_types():
    exp = apply_overrides(
        get_experiment("dirmoe-tiny"),
        ["steps=12", "lr=1e-3", "seq_length=none", "distributed_optimizer=false", "router_options.kl_weight=0.1",
         "router_options.dispatch=topk"],
    )
    assert exp.steps == 12 and exp.lr == 1e-3 and exp.seq_length is None and exp.distributed_optimizer is False
    assert dict(exp.router_options) == {"kl_weight": 0.1, "dispatch": "topk"}
    # a new router drops the old router's options; options are checked against the new router
    switched = apply_overrides(exp, ["router=switch", "router_options.aux_loss_coeff=0.05"])
    assert switched.router == "switch" and dict(switched.router_options) == {"aux_loss_coeff": 0.05}
    assert apply_overrides(exp, ["router_options="]).router_options == ()


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("nope=1", "unknown key 'nope'; valid: .*steps"),
        ("steps=abc", "steps: expected an integer"),
        ("lr=fast", "lr: expected a number"),
        ("steps", "key=value"),
        ("router_options.nope=1", "unknown option 'nope' for router 'dirmoe'; valid: .*kl_weight"),
        ("router_options.dispatch=bogus", "dispatch"),
        ("global_batch_size=7", "multiple of micro_batch_size"),
        ("precision=fp16", "precision must be one of"),
        ("router=bogus", "unknown router 'bogus'"),
    ],
)
def test_bad_overrides_are_one_line_errors(assignment, message):
    with pytest.raises(ReproError, match=message) as info:
        apply_overrides(get_experiment("dirmoe-tiny"), [assignment])
    assert "\n" not in str(info.value)


def test_cli_errors_and_list(tmp_path, capsys):
    from repro.cli import main

    assert main(["train", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "dirmoe-tiny" in listed and "switch-185m" in listed
    assert main(["train", "--experiment", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown experiment 'nope'; valid:") and "\n" not in err
    assert main(["train", "--experiment", "switch-tiny", "--set", "bogus=1", "--out", str(tmp_path)]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert str(tmp_path / "none") in capsys.readouterr().err


def test_cli_trains(tmp_path, capsys):
    from repro.cli import main

    args = ["train", "--experiment", "hash-tiny", "--out", str(tmp_path), "--no-progress"]
    for item in TINY + ["steps=2"]:
        args += ["--set", item]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["experiment"] == "hash-tiny" and summary["steps"] == 2


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
    with pytest.raises(ValueError):
        WarmupCosineSchedule(1.0, 2.0, 0, 10)

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


def test_training_leaves_megatron_aux_loss_scale_as_it_was(tmp_path):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from repro.training.loop import train

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    before = before.clone() if before is not None else None
    train(_experiment("switch", ["steps=1"]), tmp_path, progress=False)  # sets 1 / 2 micro-batches inside
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
