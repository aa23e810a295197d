"""Task-data folders for the papers' seven tasks: what lm-eval's YAMLs read, the layout, checks and fetching.

The download itself needs the Hugging Face hub and is not exercised here; ``fetch`` is run with a loader that
reads the fixtures, so everything it does besides the download (the plan, the layout, the refusals) is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import pytest
import yaml

from repro.cli import main as repro_main
from repro.errors import ReproError
from repro.evaluation.task_data import (
    CARD,
    PAPER_TASK_DIRS,
    check_task_data,
    dataset_card,
    fetch,
    fetch_plan,
    task_data_specs,
    write_task_overrides,
)

FIXTURES = Path(__file__).parent / "fixtures" / "tasks_data"
SEVEN = list(PAPER_TASK_DIRS)

#: What lm-eval 0.4.13's YAMLs read (DESIGN.md section 9): dataset, config, every split named, scored split.
EXPECTED = {
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", ("train", "validation", "test"), "test"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", ("train", "validation", "test"), "test"),
    "boolq": ("aps/super_glue", "boolq", ("train", "validation"), "validation"),
    "hellaswag": ("Rowan/hellaswag", None, ("train", "validation"), "validation"),
    "lambada_openai": ("EleutherAI/lambada_openai", "default", ("test",), "test"),
    "piqa": ("baber/piqa", None, ("train", "validation"), "validation"),
    "race": ("EleutherAI/race", "high", ("test",), "test"),
}


@pytest.fixture(scope="module")
def specs():
    return task_data_specs(SEVEN)


def test_specs_come_from_lm_evals_yamls(specs):
    assert {s.task: (s.dataset_path, s.dataset_name, s.splits, s.eval_split) for s in specs} == EXPECTED
    for spec in specs:
        assert spec.yaml_path.is_file() and "lm_eval/tasks" in spec.yaml_path.as_posix()
    with pytest.raises(ReproError, match="'ai2_arc' is an lm-eval tag"):
        task_data_specs(["arc_easy", "ai2_arc"])


@pytest.mark.slow
def test_the_fast_index_agrees_with_lm_evals_whole_task_tree(specs, monkeypatch):
    import lm_eval.tasks

    whole_tree = lm_eval.tasks.TaskManager()  # about ten seconds: indexed once, for the errors below too
    full = whole_tree.task_index
    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda *a, **kw: real(*a, **kw) if a or kw else whole_tree)
    for spec in specs:
        assert full[spec.task].yaml_path == spec.yaml_path
        assert full[spec.task].cfg["dataset_path"] == spec.dataset_path
    with pytest.raises(ReproError, match="unknown lm-eval task.*no_such_task"):
        task_data_specs(["arc_easy", "no_such_task"])  # not among the seven: the whole tree is searched
    with pytest.raises(ReproError, match="task 'prost' does not read a Hugging Face hub dataset"):
        task_data_specs(["prost"])  # dataset_path: json with its own data_files


def test_fetch_plan_groups_configs_by_dataset(specs, tmp_path):
    plan = fetch_plan(specs)
    assert [(p.dataset_path, p.tasks) for p in plan] == [
        ("allenai/ai2_arc", ("arc_challenge", "arc_easy")),
        ("aps/super_glue", ("boolq",)),
        ("Rowan/hellaswag", ("hellaswag",)),
        ("EleutherAI/lambada_openai", ("lambada_openai",)),
        ("baber/piqa", ("piqa",)),
        ("EleutherAI/race", ("race",)),
    ]
    assert plan[0].configs == (("ARC-Challenge", ("train", "validation", "test")), ("ARC-Easy", ("train", "validation", "test")))
    assert plan[0].describe(tmp_path) == (
        "allenai/ai2_arc: ARC-Challenge [train, validation, test], ARC-Easy [train, validation, test] -> "
        f"{tmp_path}/allenai/ai2_arc (tasks: arc_challenge, arc_easy)"
    )


def _header(card_text: str) -> dict:
    return yaml.safe_load(card_text.split("---\n")[1])


def test_fixtures_are_laid_out_as_fetch_writes(specs, tmp_path):
    for item in fetch_plan(specs):
        card = (FIXTURES / item.dataset_path / CARD).read_text()
        assert _header(card) == _header(dataset_card(item, "note")), item.dataset_path
    check_task_data(specs, FIXTURES)  # every config and split each task reads is there
    # each fixture document has the fields lm-eval's task reads, in the hub dataset's schema
    rows = {
        s.task: datasets.load_dataset(str(s.folder(FIXTURES)), s.dataset_name, cache_dir=str(tmp_path / "c"))[s.eval_split]
        for s in specs
    }
    assert all(4 <= len(r) <= 8 for r in rows.values())
    assert {"id", "question", "choices", "answerKey"} <= set(rows["arc_easy"].column_names)
    assert {"passage", "question", "label", "idx"} <= set(rows["boolq"].column_names)
    assert {"ctx_a", "ctx_b", "activity_label", "endings", "label"} <= set(rows["hellaswag"].column_names)
    assert rows["lambada_openai"].column_names == ["text"]
    assert {"goal", "sol1", "sol2", "label"} <= set(rows["piqa"].column_names)
    assert rows["race"].column_names == ["article", "problems"]


def test_missing_or_incomplete_data_is_one_line_naming_task_and_folder(specs, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(FIXTURES, partial)
    shutil.rmtree(partial / "EleutherAI" / "race")
    with pytest.raises(ReproError) as info:
        check_task_data(specs, partial)
    text = str(info.value)
    assert "\n" not in text
    assert f"task 'race': no EleutherAI/race in {partial / 'EleutherAI' / 'race'}" in text
    assert "eval fetch" in text and "--tasks race" in text and "piqa" not in text
    (partial / "baber" / "piqa" / "default" / "train.jsonl").unlink()
    card = partial / "baber" / "piqa" / CARD
    card.write_text(card.read_text().replace("  - split: train\n    path: default/train.jsonl\n", ""))
    with pytest.raises(ReproError, match=r"task 'piqa': .*baber/piqa config 'default' lacks split\(s\) train \(has: validation\)"):
        check_task_data([s for s in specs if s.task == "piqa"], partial)
    arc_card = partial / "allenai" / "ai2_arc" / CARD
    arc_card.write_text(arc_card.read_text().replace("config_name: ARC-Easy", "config_name: ARC-Other"))
    with pytest.raises(ReproError, match="task 'arc_easy': .*has no usable config 'ARC-Easy'"):
        check_task_data([s for s in specs if s.task == "arc_easy"], partial)
    with pytest.raises(ReproError, match="no such task-data folder"):
        check_task_data(specs, tmp_path / "nowhere")


def test_overrides_change_only_where_the_data_is(specs, tmp_path):
    out = write_task_overrides(specs, FIXTURES, tmp_path / "tasks")
    for spec in specs:
        config = yaml.safe_load((out / f"{spec.task}.yaml").read_text())
        assert config == {
            "include": str(spec.yaml_path),
            "task": spec.task,
            "dataset_path": str(FIXTURES.resolve() / spec.dataset_path),
            "dataset_kwargs": {"cache_dir": str(out / ".hf_cache")},
        }


def _fixture_loader(calls, cache):
    """Stands in for ``datasets.load_dataset(hub_name, config)``: the same call on the fixture folder."""

    def load(path: str, name: str | None):
        calls.append((path, name))
        return datasets.load_dataset(str(FIXTURES / path), name, cache_dir=str(cache))

    return load


def test_fetch_writes_the_layout_and_never_changes_existing_folders(specs, tmp_path):
    calls: list = []
    out = tmp_path / "data"
    written = fetch(fetch_plan(specs), out, load=_fixture_loader(calls, tmp_path / "hf"), log=lambda _: None)
    assert written == [out / p for p in ("allenai/ai2_arc", "aps/super_glue", "Rowan/hellaswag",
                                          "EleutherAI/lambada_openai", "baber/piqa", "EleutherAI/race")]
    assert ("allenai/ai2_arc", "ARC-Easy") in calls and ("Rowan/hellaswag", None) in calls
    check_task_data(specs, out)
    for spec in specs:  # the same documents, read back through datasets from the written layout
        for split in spec.splits:
            fetched = datasets.load_dataset(str(spec.folder(out)), spec.dataset_name, split=split, cache_dir=str(tmp_path / "hf"))
            original = datasets.load_dataset(str(spec.folder(FIXTURES)), spec.dataset_name, split=split,
                                             cache_dir=str(tmp_path / "hf"))
            assert fetched.to_list() == original.to_list(), (spec.task, split)
    assert "datasets" in (out / "allenai" / "ai2_arc" / CARD).read_text()  # provenance in the card's text

    # a complete folder is kept as it is: nothing downloaded again
    calls.clear()
    assert fetch(fetch_plan(specs), out, load=_fixture_loader(calls, tmp_path / "hf"), log=lambda _: None) == []
    assert calls == []
    # an incomplete one is refused and left untouched
    (out / "baber" / "piqa" / "default" / "train.jsonl").unlink()
    before = sorted(p.name for p in (out / "baber" / "piqa").rglob("*"))
    with pytest.raises(ReproError, match="baber/piqa exists but lacks"):
        fetch(fetch_plan(specs), out, load=_fixture_loader(calls, tmp_path / "hf"), log=lambda _: None)
    assert sorted(p.name for p in (out / "baber" / "piqa").rglob("*")) == before


def test_fetch_of_a_dataset_without_a_needed_split_leaves_nothing(specs, tmp_path):
    def lacking(path, name):
        data = datasets.load_dataset(str(FIXTURES / path), name, cache_dir=str(tmp_path / "hf"))
        return {k: v for k, v in data.items() if k != "train"}

    out = tmp_path / "data"
    with pytest.raises(ReproError, match="allenai/ai2_arc config 'ARC-Challenge' has no split\\(s\\) train"):
        fetch(fetch_plan(specs[:1]), out, load=lacking, log=lambda _: None)
    assert not out.exists()


def test_eval_data_command(tmp_path, capsys):
    # dry run: the plan, nothing downloaded or written
    assert repro_main(["eval", "fetch", "--out", str(tmp_path / "d"), "--tasks", "piqa,race", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "baber/piqa: default [train, validation]" in out and "EleutherAI/race: high [test]" in out
    assert not (tmp_path / "d").exists()
    # the tests run offline: fetching for real is refused with one line
    assert repro_main(["eval", "fetch", "--out", str(tmp_path / "d"), "--tasks", "piqa"]) == 2
    assert "HF_DATASETS_OFFLINE" in capsys.readouterr().err and not (tmp_path / "d").exists()
    assert repro_main(["eval", "check", str(FIXTURES)]) == 0
    assert "complete" in capsys.readouterr().out
    assert repro_main(["eval", "check", str(tmp_path), "--tasks", "boolq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: task 'boolq': no aps/super_glue in") and err.count("\n") == 1
