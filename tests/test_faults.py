"""Fault injection: bad output paths, full and read-only disks, kills while writing, malicious and altered
checkpoints, symlinks out of the output, broken tokenizer files and huge documents.

Every case checks the same three things: the command stops with one line naming the path and the cause,
nothing it did not create is removed or written through, and nothing partial is left behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from repro import cli
from repro.errors import ReproError
from repro.io_utils import atomic_path, check_output_path, claim_run_dir, open_in_dir, write_json_atomic
from repro.training import checkpoint as ckpt
from repro.training.distributed import Parallel

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers
def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (relative) with a file's bytes, None for a directory or a link's target."""
    out: dict[str, bytes | None] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = os.readlink(p).encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
        else:
            out[rel] = None
    return out


def _fake_run_dir(root: Path) -> Path:
    """A directory that looks like a training run: the user's data a bad --out must never remove."""
    (root / "checkpoints" / "step_0000002").mkdir(parents=True)
    (root / "checkpoints" / "step_0000002" / "rank_00000.pt").write_bytes(b"weights of a week of training")
    (root / "checkpoints" / "step_0000002" / "meta.json").write_text("{}")
    (root / "log.jsonl").write_text('{"step": 1}\n')
    return root


@contextlib.contextmanager
def _tmpfs(path: Path, size: str = "2m", read_only: bool = False):
    """Mount a small tmpfs at ``path`` (a real full or read-only disk); skip where mounting is not allowed.

    The same faults are also injected with mocks in the tests beside, which run everywhere.
    """
    path.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    opts = f"size={size}" + (",ro" if read_only else "")
    if mount is None or subprocess.run([mount, "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                                       capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root here; the mocked variant of this fault runs instead")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --------------------------------------------------------------- 1. outputs that are not ours
def test_atomic_write_refuses_an_existing_directory(tmp_path):
    run = _fake_run_dir(tmp_path / "run")
    before = _tree(run)
    with pytest.raises(ReproError, match=rf"{run}: exists and is a directory") as info:
        write_json_atomic(run, {"results": {}})
    _one_line(str(info.value))
    assert _tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary left beside it


def test_atomic_path_replaces_a_directory_only_when_the_caller_recognises_it(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(ReproError, match="exists and is a directory"):
        with atomic_path(target, replace=lambda p: False) as tmp:
            tmp.mkdir()
    assert (target / "old.txt").read_text() == "old"
    with atomic_path(target, replace=lambda p: (p / "old.txt").is_file()) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # a directory never replaces a file it was not allowed to replace
    plain = tmp_path / "plain.txt"
    plain.write_text("keep")
    with pytest.raises(ReproError, match=rf"{plain}: exists and is not a directory"):
        with atomic_path(plain) as tmp:
            tmp.mkdir()
    assert plain.read_text() == "keep"


def test_atomic_path_refuses_symlinks_and_leaves_their_targets_alone(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    link = tmp_path / "out" / "result.json"
    link.parent.mkdir()
    link.symlink_to(outside)
    with pytest.raises(ReproError, match=rf"{link}: is a symbolic link"):
        write_json_atomic(link, {"a": 1})
    assert outside.read_text() == "precious" and link.is_symlink()


def test_check_output_path_is_the_same_rule_before_any_work(tmp_path):
    run = _fake_run_dir(tmp_path / "run")
    with pytest.raises(ReproError, match="exists and is a directory"):
        check_output_path(run)
    check_output_path(tmp_path / "new" / "file.json")  # absent: fine, and nothing is created
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "x.json"
    existing.write_text("{}")
    check_output_path(existing)
    with pytest.raises(ReproError, match=rf"{existing}: exists and was not written by this command"):
        check_output_path(existing, replace=lambda p: False)


def _heldout(path: Path, docs: int = 12) -> Path:
    words = "the quick brown fox jumps over the lazy dog while a stitch in time saves nine".split()
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(words[(i + j) % len(words)] for j in range(300)) + "."
            f.write(json.dumps({"text": text, "meta": {"pile_set_name": f"d{i % 3}"}}) + "\n")
    return path


def _patch_eval(monkeypatch) -> list:
    """Stand-ins for the checkpoint loader and lm-eval, so the eval command reaches its writes in seconds."""
    from repro.evaluation import runner
    from repro.evaluation.harness import SuiteLM

    calls: list = []

    def fake_evaluate(lm, tasks=None, **kwargs):
        calls.append(tasks)
        return {"results": {"minipile_ppl": {"bits_per_byte,none": 1.5}}, "versions": {"minipile_ppl": 1},
                "configs": {}}

    monkeypatch.setattr(SuiteLM, "from_checkpoint", classmethod(lambda cls, path, **kw: object()))
    monkeypatch.setattr(runner, "evaluate_lm", fake_evaluate)
    monkeypatch.setattr("lm_eval.utils.make_table", lambda results: "table")
    return calls


def test_eval_out_refuses_a_run_directory_before_evaluating(tmp_path, monkeypatch, capsys):
    calls = _patch_eval(monkeypatch)
    run = _fake_run_dir(tmp_path / "run")
    before = _tree(run)
    status = cli.main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(run)])
    err = capsys.readouterr().err
    assert status == 2 and _one_line(err).startswith(f"error: {run}: exists and is a directory")
    assert _tree(run) == before and calls == []  # refused before the (long) evaluation

    # an earlier result of this command is replaced; another file at that path is not
    out = tmp_path / "lm_eval.json"
    assert cli.main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert cli.main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["versions"] == {"minipile_ppl": 1}
    config = tmp_path / "config.json"
    config.write_text('{"experiment": {}}')
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(config)]) == 2
    assert "not written by this command" in _one_line(capsys.readouterr().err)
    assert config.read_text() == '{"experiment": {}}'


def test_local_tasks_refuse_a_run_directory(tmp_path, monkeypatch, capsys):
    from repro.evaluation.local_tasks import build_local_tasks

    calls = _patch_eval(monkeypatch)
    heldout = _heldout(tmp_path / "heldout.jsonl")
    run = _fake_run_dir(tmp_path / "run")
    before = _tree(run)
    argv = ["eval", "--checkpoint", str(tmp_path / "ckpt"), "--local-tasks", str(run),
            "--local-tasks-from", str(heldout), "--out", str(tmp_path / "out.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line(err).startswith(f"error: {run}: exists and is a directory") and calls == []
    assert _tree(run) == before and not (tmp_path / "out.json").exists()
    # its own earlier output is rebuilt in place
    tasks = build_local_tasks(heldout, tmp_path / "tasks")
    (tasks / "minipile_ppl.jsonl").write_text("stale\n")
    build_local_tasks(heldout, tasks)
    assert (tasks / "minipile_ppl.jsonl").read_text() != "stale\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.jsonl", "run", "tasks"]


def test_train_bpe_tokenizer_replaces_only_a_tokenizer_directory(tmp_path):
    from repro.data.tokenizer import train_bpe_tokenizer

    texts = ["hello world, hello tokenizer"] * 20
    train_bpe_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    train_bpe_tokenizer(texts, tmp_path / "tok", vocab_size=300)  # its own output: replaced
    run = _fake_run_dir(tmp_path / "run")
    before = _tree(run)
    with pytest.raises(ReproError, match="exists and is a directory"):
        train_bpe_tokenizer(texts, run, vocab_size=300)
    assert _tree(run) == before


def test_mini_pile_refuses_a_directory_holding_other_files(tmp_path):
    from repro.data.minipile import MiniPileConfig, build_mini_pile

    run = _fake_run_dir(tmp_path / "run")
    before = _tree(run)
    with pytest.raises(ReproError, match=rf"{run}: holds files that are not the mini-pile's"):
        build_mini_pile(run, MiniPileConfig(max_bytes_per_domain=10_000, vocab_size=300))
    assert _tree(run) == before


def test_indexed_output_refuses_files_it_did_not_write(tmp_path, tokenizer):
    from repro.data.indexed import tokenize_shards
    from repro.data.pile import PileRecord, write_pile_shard

    shard = tmp_path / "in.jsonl"
    write_pile_shard(shard, [PileRecord("some text here", "A")])
    out = tmp_path / "out"
    out.mkdir()
    (out / "ds.bin").write_bytes(b"someone else's binary")
    with pytest.raises(ReproError, match=rf"{out / 'ds.bin'}: exists and was not written by"):
        tokenize_shards([shard], tokenizer, out / "ds")
    assert (out / "ds.bin").read_bytes() == b"someone else's binary"
    (out / "ds.bin").unlink()
    (out / "ds.idx").mkdir()
    with pytest.raises(ReproError, match=rf"{out / 'ds.idx'}: exists and is a directory"):
        tokenize_shards([shard], tokenizer, out / "ds")
    (out / "ds.idx").rmdir()
    tokenize_shards([shard], tokenizer, out / "ds")
    tokenize_shards([shard], tokenizer, out / "ds")  # its own earlier output: replaced
    assert sorted(p.name for p in out.iterdir()) == ["ds.bin", "ds.domains.json", "ds.domains.npy", "ds.idx"]


# ---------------------------------------------------- 5, 7, 12. data tokenize and tokenizer files
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from repro.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog", "def f(x):\n    return x + 1\n"] * 50
    vocab, merges = train_bpe_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tok", vocab_size=320)
    return load_tokenizer(vocab, merges)


def _tokenize_args(tmp_path: Path, tokenizer, out_prefix: Path) -> list[str]:
    from repro.data.pile import PileRecord, write_pile_shard

    shard = tmp_path / "shard.jsonl"
    write_pile_shard(shard, [PileRecord(f"document {i} with some words", "A") for i in range(50)])
    return ["data", "tokenize", "--input", str(shard), "--vocab", str(tokenizer.vocab_path), "--merges",
            str(tokenizer.merges_path), "--out", str(out_prefix), "--no-progress", "--workers", "1"]


def test_tokenize_checks_the_tokenizer_clash_before_writing(tmp_path, tokenizer, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "vocab.json").write_text('{"<|endoftext|>": 0}')  # another tokenizer's file
    argv = _tokenize_args(tmp_path, tokenizer, out / "corpus")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line(err).startswith(f"error: {out / 'vocab.json'}: another tokenizer's file")
    assert sorted(p.name for p in out.iterdir()) == ["vocab.json"]  # no dataset written first


def test_tokenize_never_writes_through_a_symlink_out_of_the_output(tmp_path, tokenizer, capsys):
    out = tmp_path / "data"
    out.mkdir()
    victim = tmp_path / "elsewhere" / "merges.txt"
    victim.parent.mkdir()
    (out / "merges.txt").symlink_to(victim)  # dangling: copying "through" it would create the victim
    assert cli.main(_tokenize_args(tmp_path, tokenizer, out / "corpus")) == 2
    err = capsys.readouterr().err
    assert _one_line(err).startswith(f"error: {out / 'merges.txt'}: is a symbolic link")
    assert not victim.exists() and sorted(p.name for p in out.iterdir()) == ["merges.txt"]
    # a symlink inside the output to the very same file is fine: nothing needs writing
    (out / "merges.txt").unlink()
    shutil.copyfile(tokenizer.merges_path, out / "real-merges.txt")
    (out / "merges.txt").symlink_to("real-merges.txt")
    assert cli.main(_tokenize_args(tmp_path, tokenizer, out / "corpus")) == 0
    assert (out / "vocab.json").read_bytes() == tokenizer.vocab_path.read_bytes()


@pytest.mark.parametrize("content", ["", "#version: 0.2\n", "\n\n"])
def test_empty_merges_file_is_refused(tmp_path, tokenizer, content):
    from repro.data.tokenizer import load_tokenizer

    merges = tmp_path / "merges.txt"
    merges.write_text(content)
    with pytest.raises(ReproError, match=rf"{merges}: no merges"):
        load_tokenizer(tokenizer.vocab_path, merges)


def test_a_run_directory_claim_never_follows_or_replaces_a_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".mini-run").write_text("looks like ours")
    (tmp_path / "run").symlink_to(target)
    with pytest.raises(ReproError, match="run: is a symbolic link"):
        claim_run_dir(tmp_path / "run", marker=".mini-run", owner="the mini comparison", command="python -m repro study mini")
    assert (target / ".mini-run").read_text() == "looks like ours"


def test_open_in_dir_refuses_symlinks_out_of_the_directory(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    (root / "log.jsonl").symlink_to(outside)
    with pytest.raises(ReproError, match=rf"{root / 'log.jsonl'}: .*outside {root}"):
        open_in_dir(root, "log.jsonl", "a")
    (root / "dangling").symlink_to(tmp_path / "created-through-link")
    with pytest.raises(ReproError, match="outside"):
        open_in_dir(root, "dangling", "w")
    with pytest.raises(ReproError, match="outside"):
        open_in_dir(root, "../escape.txt", "w")
    assert outside.read_text() == "keep\n" and not (tmp_path / "created-through-link").exists()
    assert not (tmp_path / "escape.txt").exists()
    # a plain file and a link that stays inside are opened as usual
    (root / "real.jsonl").write_text("a\n")
    (root / "inside.jsonl").symlink_to("real.jsonl")
    with open_in_dir(root, "inside.jsonl", "a") as f:
        f.write("b\n")
    with open_in_dir(root, "new.jsonl", "a") as f:
        f.write("c\n")
    assert (root / "real.jsonl").read_text() == "a\nb\n" and (root / "new.jsonl").read_text() == "c\n"


# ----------------------------------------------------------------------- 11. disks that fail
def test_output_inside_a_regular_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ReproError, match=rf"not a directory: {blocker}") as info:
        write_json_atomic(blocker / "sub" / "out.json", {})
    _one_line(str(info.value))
    assert blocker.read_text() == "x"


def test_full_disk_mocked_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def full(fd):
        raise _enospc()

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "new" / "deeper" / "out.json"
    with pytest.raises(ReproError, match=rf"^no space left on device: {out}$"):
        write_json_atomic(out, {"a": 1})
    assert list(tmp_path.iterdir()) == []  # not even the parents it created


def test_read_only_directory_mocked_is_one_line(tmp_path, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ReproError, match=rf"^read-only file system: {tmp_path / 'out.json'}$"):
        write_json_atomic(tmp_path / "out.json", {})


def test_read_only_disk_real(tmp_path, capsys):
    ro = tmp_path / "ro"
    with _tmpfs(ro, read_only=True):
        with pytest.raises(ReproError, match=rf"^read-only file system: {ro / 'out.json'}$"):
            write_json_atomic(ro / "out.json", {})
        assert cli.main(["eval", "--checkpoint", str(tmp_path), "--out", str(ro / "r.json")]) == 2
        assert _one_line(capsys.readouterr().err) == f"error: read-only file system: {ro / 'r.json'}\n"


def test_tokenize_on_a_full_disk_or_through_a_file_is_one_line(tmp_path, tokenizer, capsys):
    from repro.data.pile import PileRecord, write_pile_shard

    shard = tmp_path / "shard.jsonl"
    write_pile_shard(shard, [PileRecord("the quick brown fox jumps over the lazy dog " * 4000, "A")] * 10)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    args = ["data", "tokenize", "--input", str(shard), "--vocab", str(tokenizer.vocab_path), "--merges",
            str(tokenizer.merges_path), "--no-progress", "--workers", "1", "--out"]
    assert cli.main(args + [str(blocker / "data" / "corpus")]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"error: not a directory: {blocker}")
    small = tmp_path / "small"
    with _tmpfs(small, size="512k"):
        assert cli.main(args + [str(small / "data" / "corpus")]) == 2
        assert _one_line(capsys.readouterr().err) == f"error: no space left on device: {small / 'data' / 'corpus'}\n"
        assert list(small.iterdir()) == []  # no temporary, not even the directory made for the output


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))


def _save(root: Path, model: nn.Module, step: int = 1, experiment: dict | None = None) -> Path:
    return ckpt.save_checkpoint(
        root,
        step=step,
        consumed_samples=8 * step,
        parallel=Parallel(),
        experiment=experiment or _experiment("switch"),
        model=model,
        optimizer_state={"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]},
        scheduler_state={"num_steps": step, "schedule": {"peak_lr": 1e-3}},
    )


def _experiment(router: str) -> dict:
    from repro.experiments import get_experiment

    return get_experiment(f"{router}-tiny").to_dict()


def test_checkpoint_on_a_full_disk_mocked(tmp_path, monkeypatch):
    def full_disk_save(obj, f, *args, **kwargs):
        f.write(b"\0" * 100)  # what torch does: a RuntimeError whose context is the OSError
        try:
            raise _enospc()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") from None

    monkeypatch.setattr(torch, "save", full_disk_save)
    root = tmp_path / "checkpoints"
    with pytest.raises(ReproError, match=rf"^no space left on device: {root}"):
        _save(root, _model())
    assert list(root.iterdir()) == []


def test_checkpoint_on_a_full_disk_real(tmp_path):
    small = tmp_path / "small"
    with _tmpfs(small, size="2m"):
        root = small / "checkpoints"
        model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512))  # 3 MB of weights
        with pytest.raises(ReproError, match=rf"^no space left on device: {root}") as info:
            _save(root, model)
        _one_line(str(info.value))
        assert list(root.iterdir()) == []


# ------------------------------------------------------------- 4. killed while checkpointing
def test_kill_while_writing_the_first_checkpoint_is_told_apart_from_no_run(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from repro.training import checkpoint as ckpt
        from repro.training.distributed import Parallel

        def killed(obj, f, *args, **kwargs):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = killed
        ckpt.save_checkpoint({str(root)!r}, step=1, consumed_samples=8, parallel=Parallel(), experiment={{}},
                             model=nn.Linear(2, 2), optimizer_state={{}}, scheduler_state={{}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert ckpt.find_latest_checkpoint(root) is None
    assert ckpt.incomplete_checkpoints(root) == [root / ".step_0000001.tmp"]
    assert ckpt.incomplete_checkpoints(tmp_path / "no-run" / "checkpoints") == []
    # the next write of that step completes and clears the leftover
    _save(root, _model())
    assert ckpt.incomplete_checkpoints(root) == []
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001"]


# --------------------------------------------------- 6, 8. checkpoints: plain data, digests, identity
class _Payload:
    """Runs a shell command when unpickled: what a full unpickling load would let a checkpoint do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _set_digest(checkpoint_dir: Path, name: str) -> None:
    """What an attacker who can write the directory also does: make meta.json vouch for the new file."""
    meta_path = checkpoint_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["sha256"][name] = ckpt.file_sha256(checkpoint_dir / name)
    meta_path.write_text(json.dumps(meta))


def test_malicious_rank_file_is_never_unpickled(tmp_path):
    model = _model()
    path = _save(tmp_path / "checkpoints", model)
    marker = tmp_path / "pwned"
    rank_file = path / "rank_00000.pt"
    torch.save({"format": ckpt.FORMAT_VERSION, "model": _Payload(marker)}, rank_file)
    with pytest.raises(ReproError, match=rf"{rank_file}: .*sha256"):
        ckpt.load_rank_payload(ckpt.read_checkpoint_info(path), 0)
    _set_digest(path, "rank_00000.pt")
    for load in (lambda: ckpt.load_rank_payload(ckpt.read_checkpoint_info(path), 0),
                 lambda: ckpt.load_model_weights(path, _model(), Parallel())):
        with pytest.raises(ReproError, match=rf"{rank_file}: refusing to load: .*(posix|nt|os)\.system") as info:
            load()
        _one_line(str(info.value))
    assert not marker.exists()


def test_checkpoint_holds_only_tensors_and_plain_data_and_restores_every_rng(tmp_path):
    import random

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state too
    path = _save(tmp_path / "checkpoints", _model())
    payload = torch.load(path / "rank_00000.pt", weights_only=True)  # no allow-list needed
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    ckpt.restore_rng_state(payload["rng"])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_only_plain_data_is_ever_saved(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(ValueError, match=r"payload\['extra'\]\['stats'\] is a numpy.ndarray"):
        ckpt.save_checkpoint(root, step=1, consumed_samples=8, parallel=Parallel(), experiment={}, model=_model(),
                             optimizer_state={}, scheduler_state={}, extra={"stats": np.zeros(3)})
    assert list(root.iterdir()) == []


_TWO_RANKS = """
import errno, json, os, sys, torch
import torch.distributed as dist
from torch import nn
from repro.errors import ReproError
from repro.training import checkpoint as ckpt
from repro.training.distributed import Parallel

rank, root, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
if rank == 1:
    def full(obj, f, *args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("unexpected pos") from None
    torch.save = full
try:
    ckpt.save_checkpoint(root, step=1, consumed_samples=8, parallel=Parallel(rank=rank, world_size=2, dp_size=2),
                         experiment={}, model=nn.Linear(2, 2), optimizer_state={}, scheduler_state={})
    print("saved")
except ReproError as exc:
    print(f"error: {exc}")
finally:
    # gloo's threads must stop before the interpreter does ("terminate called without an active exception").
    dist.destroy_process_group()
"""


def test_a_failed_write_on_one_rank_stops_every_rank(tmp_path):
    root = tmp_path / "checkpoints"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), str(root), str(tmp_path / "store")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out = [p.communicate(timeout=180) for p in procs]  # a plain barrier would leave rank 0 waiting forever
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in out]
    final = root / "step_0000001"
    assert out[0][0].strip() == f"error: {final}: checkpoint not written: the write failed on another rank"
    assert out[1][0].strip() == f"error: no space left on device: {final}"
    assert list(root.iterdir()) == []


def test_a_changed_byte_inside_a_tensor_is_detected(tmp_path):
    path = _save(tmp_path / "checkpoints", _model())
    rank_file = path / "rank_00000.pt"
    data = bytearray(rank_file.read_bytes())
    weights = _model()[0].weight.detach().numpy().tobytes()
    at = bytes(data).find(weights[:64])
    assert at > 0
    data[at + 10] ^= 0x01  # one bit of one weight: still a valid zip and a valid tensor
    rank_file.write_bytes(bytes(data))
    with pytest.raises(ReproError, match=rf"{rank_file}: changed since it was written \(sha256 "):
        ckpt.load_model_weights(path, _model(), Parallel())


def test_rank_file_of_another_run_is_refused_naming_both(tmp_path):
    switch = _save(tmp_path / "switch" / "checkpoints", _model(), experiment=_experiment("switch"))
    ec = _save(tmp_path / "ec" / "checkpoints", _model(), experiment=_experiment("expert_choice"))
    shutil.copyfile(switch / "rank_00000.pt", ec / "rank_00000.pt")
    for digest_too in (False, True):
        if digest_too:
            _set_digest(ec, "rank_00000.pt")
        with pytest.raises(ReproError, match=r"router 'switch'.*router 'expert_choice'") as info:
            ckpt.load_model_weights(ec, _model(), Parallel())
        _one_line(str(info.value))
    info = ckpt.read_checkpoint_info(switch)
    ckpt.check_identity(info, _experiment("switch"))
    with pytest.raises(ReproError, match=r"router 'switch'.*router 'expert_choice'"):
        ckpt.check_identity(info, _experiment("expert_choice"))


def test_identity_is_what_defines_the_model():
    from repro.config import apply_overrides
    from repro.experiments import get_experiment

    base = apply_overrides(get_experiment("dirmoe-tiny"), ["router.options.sparsity_weight=0.01"])
    identity = ckpt.run_identity(base.to_dict())
    assert identity["router"] == "dirmoe" and identity["router_options"] == {"sparsity_weight": 0.01}
    assert identity["flavour"] == "tiny"
    # the optimizer does not define the model; a router option and the number of experts do
    assert ckpt.run_identity(apply_overrides(base, ["optimizer.lr=1e-2"]).to_dict()) == identity
    assert ckpt.run_identity(apply_overrides(base, ["router.options.sparsity_weight=0.1"]).to_dict()) != identity
    assert ckpt.run_identity(apply_overrides(base, ["model.num_experts=4"]).to_dict()) != identity


# ------------------------------------------------------------------------- 13. huge documents
def test_long_documents_are_encoded_in_chunks_with_the_same_tokens(tokenizer, monkeypatch):
    from repro.data import tokenizer as tok_module

    rng = np.random.default_rng(0)
    # unusual whitespace too: the cut rule must agree with the pre-tokenizer's idea of a space
    words = ["the", "quick", "brown", "fox", "x=1;", "\n", "  ", "\t", "don't", "naïve", "東京", "12345", "\u00a0",
             "\u2028", "\x1c", " \n"]
    text = " ".join(rng.choice(words, size=3000))
    whole = tokenizer._tok.encode(text, add_special_tokens=False).ids  # the unchunked reference
    seen: list[int] = []
    encode_batch = tokenizer._tok.encode_batch_fast

    def spy(texts, **kwargs):
        seen.extend(len(t) for t in texts)
        return encode_batch(texts, **kwargs)

    monkeypatch.setattr(tok_module, "MAX_CHUNK_CHARS", 500)
    monkeypatch.setattr(tokenizer, "_tok", type("T", (), {"encode_batch_fast": staticmethod(spy),
                                                          "encode": tokenizer._tok.encode})())
    assert tokenizer.tokenize(text) == whole
    arrays = tokenizer.encode_arrays([text, "short", text])
    assert [a.tolist() for a in arrays] == [whole, tokenizer.tokenize("short"), whole]
    assert max(seen) <= 500 and len(seen) > 3 * len(text) // 500
    # a run without whitespace longer than the cap is cut there (the only place chunks may differ)
    blob = "a" * 1200
    assert max(len(c) for c in tok_module.split_for_encoding(blob, 500)) == 500
    assert "".join(tok_module.split_for_encoding(text, 500)) == text


def test_evaluation_tells_a_run_killed_before_its_first_checkpoint_apart(tmp_path):
    from repro.training.inference import resolve_checkpoint

    (tmp_path / "run" / "checkpoints" / ".step_0000100.tmp").mkdir(parents=True)
    with pytest.raises(ReproError, match=r"no complete checkpoint yet .*\.step_0000100\.tmp"):
        resolve_checkpoint(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReproError, match="no checkpoint found"):
        resolve_checkpoint(tmp_path / "empty")


# ------------------------------------------------------------- 3. two runs on one directory, SIGKILL
@pytest.mark.slow
def test_a_second_run_on_a_locked_directory_fails_at_once_and_the_lock_dies_with_its_process(tmp_path, capsys):
    import signal
    import time

    out = tmp_path / "run"
    argv = ["train", "--experiment", "dense-tiny", "--out", str(out), "--no-progress", "--set", "data.source=synthetic",
            "--set", "schedule.steps=100000", "--set", "model.seq_length=32", "--set", "checkpoint.interval=1"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "repro", *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not any(out.glob("checkpoints/step_*/meta.json")):  # training, with a checkpoint behind it
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.5)
        capsys.readouterr()
        assert cli.main([*argv[:-2], "--resume"]) == 2  # the second run: this process
        assert _one_line(capsys.readouterr().err.strip().splitlines()[-1]).startswith(
            f"error: {out}: another run is using this directory (process {first.pid})"
        )
        rows_before = len((out / "log.jsonl").read_text().splitlines())
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    # the lock died with its process: the run resumes from its newest complete checkpoint
    assert cli.main([*argv, "--resume", "--stop-after", "0"]) == 0, capsys.readouterr().err[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) <= rows_before  # no interleaved, no gaps
