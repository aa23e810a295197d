"""The lm-eval bridge and the local tasks, with a tiny GRU language model and a BPE tokenizer trained here."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest
import torch
import yaml
from lm_eval.api.registry import get_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from repro.cli import main as repro_main
from repro.errors import ReproError
from repro.evaluation import harness
from repro.evaluation.harness import MODEL_NAME, SuiteLM
from repro.evaluation.local_tasks import LocalTaskOptions, build_local_tasks
from repro.evaluation.runner import evaluate_lm, task_manager_for
from repro.records.run_record import lm_eval_metrics
from repro.records.store import make_record
from repro.report.table_core import render
from repro.report.tables import zero_shot_table

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "all that glitters is not gold",
    "the early bird catches the worm",
    "better late than never",
    "actions speak louder than words",
    "knowledge is power and power is knowledge",
    "def main(): return 0",
]
EOD = "<|endoftext|>"


class TinyLM(nn.Module):
    """Embedding -> GRU -> linear: a causal LM implementing the bridge's ScoringModel protocol."""

    def __init__(self, vocab_size: int, eod_id: int, max_length: int = 48) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab_size, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, vocab_size)
        self.eod_id = eod_id
        self.max_length = max_length

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        hidden_BSD, _ = self.gru(self.embed(tokens_BS))
        return self.head(hidden_BSD)


class Req:
    """Stands in for lm-eval's Instance (the bridge reads ``.args``)."""

    def __init__(self, *args) -> None:
        self.args = args


class MegatronStyleTokenizer:
    """The tokenize / detokenize interface of megatron-style tokenizers, over an HF tokenizer."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return tok


@pytest.fixture(scope="module")
def model(tokenizer) -> TinyLM:
    return TinyLM(tokenizer.get_vocab_size(), tokenizer.token_to_id(EOD)).eval()


def _direct(model: TinyLM, context: list[int], continuation: list[int]) -> float:
    """The continuation's log-likelihood from one unpadded forward pass."""
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        log_probs = torch.log_softmax(model.logits(tokens[:, :-1]).float(), -1)[0]
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    return sum(float(log_probs[p, t]) for p, t in zip(positions, continuation))


def test_loglikelihood_equals_a_direct_forward(model, tokenizer):
    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=3)
    pairs = [
        ("the quick brown", " fox"),
        ("a stitch in time", " saves nine"),
        ("", "better late"),
        ("all that glitters is not gold and the early bird catches", " the worm"),
        ("knowledge is", " power and power is knowledge"),
    ]
    results = lm.loglikelihood([Req(c, x) for c, x in pairs])
    for (context, continuation), (score, greedy) in zip(pairs, results):
        ctx = lm.tok_encode(context) if context else [lm.eot_token_id]
        whole = lm.tok_encode(context + continuation)
        cont = whole[len(ctx):] if context else lm.tok_encode(continuation)
        assert score == pytest.approx(_direct(model, ctx, cont), abs=1e-4)
        assert isinstance(greedy, bool)
    # batching and right padding do not change any score
    single = SuiteLM(model=model, tokenizer=tokenizer, batch_size=1).loglikelihood([Req(c, x) for c, x in pairs])
    assert [s for s, _ in single] == pytest.approx([s for s, _ in results], abs=1e-5)
    # a megatron-style tokenizer (tokenize / detokenize, as repro.data.tokenizer's) gives the same requests
    wrapped = SuiteLM(model=model, tokenizer=MegatronStyleTokenizer(tokenizer), batch_size=3)
    assert wrapped.loglikelihood([Req(c, x) for c, x in pairs]) == results


class StartLM(TinyLM):
    """TinyLM computing the logits of positions ``start..`` alone (as the suite's checkpoints do)."""

    def logits(self, tokens_BS: torch.Tensor, start: int = 0) -> torch.Tensor:
        self.starts.append((start, tokens_BS.shape[1]))
        return super().logits(tokens_BS)[:, start:]


def test_models_taking_start_get_logits_of_the_scored_positions_alone(model, tokenizer):
    partial = StartLM(tokenizer.get_vocab_size(), tokenizer.token_to_id(EOD)).eval()
    partial.starts = []
    pairs = [("the quick brown", " fox"), ("all that glitters is not gold and the early", " bird catches the worm")]
    for batch_size in (1, 2):
        lm = SuiteLM(model=partial, tokenizer=tokenizer, batch_size=batch_size)
        assert lm.loglikelihood([Req(c, x) for c, x in pairs]) == SuiteLM(
            model=model, tokenizer=tokenizer, batch_size=batch_size
        ).loglikelihood([Req(c, x) for c, x in pairs])
    assert all(0 < start < width for start, width in partial.starts)  # the context's positions were skipped


def test_context_is_truncated_to_max_length(model, tokenizer):
    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=2, max_length=8)
    context = " ".join(SENTENCES[:3])
    (score, _), = lm.loglikelihood([Req(context, " gold")])
    whole = lm.tok_encode(context + " gold")
    n_cont = len(whole) - len(lm.tok_encode(context))
    kept = whole[-9:]  # max_length inputs + the last target
    assert score == pytest.approx(_direct(model, kept[:-n_cont], kept[-n_cont:]), abs=1e-4)
    # A continuation longer than max_length is scored on its last max_length tokens (lm-eval's HF convention).
    long_cont = " " + " ".join(SENTENCES)
    (long_score, _), = lm.loglikelihood([Req("a", long_cont)])
    context_ids, cont_ids = lm._encode_pair("a", long_cont)  # how lm-eval splits a request into tokens
    whole = context_ids + cont_ids
    assert len(cont_ids) > 8
    assert long_score == pytest.approx(_direct(model, whole[-9:-8], cont_ids[-8:]), abs=1e-4)


def test_rolling_loglikelihood(model, tokenizer):
    text = "the early bird catches the worm"
    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=4)
    (total,) = lm.loglikelihood_rolling([Req(text)])
    assert total == pytest.approx(_direct(model, [lm.eot_token_id], lm.tok_encode(text)), abs=1e-4)
    long_text = " ".join(SENTENCES * 3)  # longer than max_length: several windows
    short_ctx = SuiteLM(model=model, tokenizer=tokenizer, batch_size=4, max_length=16)
    one_by_one = SuiteLM(model=model, tokenizer=tokenizer, batch_size=1, max_length=16)
    requests = [Req(long_text), Req(text)]
    assert short_ctx.loglikelihood_rolling(requests) == pytest.approx(one_by_one.loglikelihood_rolling(requests), abs=1e-4)


def test_generate_until_is_greedy_and_batch_independent(model, tokenizer):
    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=3)
    contexts = ["the quick", "a stitch in time saves", "knowledge"]
    requests = [Req(c, {"until": ["\n"], "max_gen_toks": 6}) for c in contexts]
    outputs = lm.generate_until(requests)
    single = SuiteLM(model=model, tokenizer=tokenizer, batch_size=1).generate_until(requests)
    assert outputs == single
    # the first output by hand: argmax, append, repeat
    tokens = lm.tok_encode(contexts[0])
    generated = []
    for _ in range(6):
        with torch.no_grad():
            nxt = int(model.logits(torch.tensor([tokens + generated]))[0, -1].argmax())
        if nxt == lm.eot_token_id:
            break
        generated.append(nxt)
    assert outputs[0] == lm.tok_decode(generated).split("\n")[0]
    # a stop string cuts the text before it
    stop = outputs[1][2:4] if len(outputs[1]) >= 4 else outputs[1]
    (cut,) = lm.generate_until([Req(contexts[1], {"until": [stop], "max_gen_toks": 6})])
    assert stop not in cut and outputs[1].startswith(cut)
    with pytest.raises(ReproError, match="greedily only"):
        lm.generate_until([Req("a", {"do_sample": True})])


def _heldout(path: Path, docs: int = 12) -> Path:
    rng = random.Random(0)
    domains = ["Wikipedia (en)", "Github", "PubMed Abstracts"]
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(rng.choice(SENTENCES) for _ in range(14)) + "."
            f.write(json.dumps({"text": text, "meta": {"pile_set_name": domains[i % 3]}}) + "\n")
    return path


def test_build_local_tasks_is_deterministic(tmp_path):
    heldout = _heldout(tmp_path / "heldout.jsonl")
    first = build_local_tasks(heldout, tmp_path / "a")
    second = build_local_tasks(heldout, tmp_path / "b")
    for name in ("minipile_lastword", "minipile_continuation", "minipile_ppl"):
        assert (first / f"{name}.jsonl").read_text() == (second / f"{name}.jsonl").read_text()
        config = yaml.safe_load((first / f"{name}.yaml").read_text())
        data_file = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert data_file.is_absolute() and data_file == first / f"{name}.jsonl"
        assert config["dataset_path"] == "json" and config["tag"] == ["minipile"]
    docs = [json.loads(line) for line in (first / "minipile_continuation.jsonl").read_text().splitlines()]
    texts = [" ".join(json.loads(line)["text"].split()) for line in heldout.read_text().splitlines()]
    opts = LocalTaskOptions()
    span = opts.context_words + opts.continuation_words
    # One question per full window of `span` words, at most windows_per_doc per document.
    assert len(docs) == sum(min(opts.windows_per_doc, len(t.split(" ")) // span) for t in texts) >= 12
    starts = [
        " ".join(t.split(" ")[i : i + span]) for t in texts for i in range(0, span * opts.windows_per_doc, span)
    ]
    for doc in docs:
        true = doc["choices"][doc["label"]]
        assert len(doc["choices"]) == 4 and doc["context"] + " " + true in starts
    lastword = [json.loads(line) for line in (first / "minipile_lastword.jsonl").read_text().splitlines()]
    assert all(d["target"].startswith(" ") and d["target"][1:].isalpha() for d in lastword)
    reseeded = build_local_tasks(heldout, tmp_path / "c", LocalTaskOptions(seed=7))
    assert (reseeded / "minipile_continuation.jsonl").read_text() != (first / "minipile_continuation.jsonl").read_text()
    sampled = build_local_tasks(heldout, tmp_path / "e", LocalTaskOptions(max_docs=5))
    assert json.loads((sampled / "manifest.json").read_text())["tasks"]["minipile_ppl"] == 5
    with pytest.raises(ReproError, match="at least 4 held-out windows"):
        build_local_tasks(_heldout(tmp_path / "small.jsonl", docs=3), tmp_path / "d")


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_local_tasks_run_end_to_end_offline(tmp_path, model, tokenizer, no_network):
    tasks = build_local_tasks(_heldout(tmp_path / "heldout.jsonl"), tmp_path / "tasks")
    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=4)
    results = evaluate_lm(lm, local_tasks=tasks, limit=4, bootstrap_iters=0)
    record = make_record(run_id="tiny", router="switch", model="tiny", config={}, lm_eval_results=results)
    metrics = lm_eval_metrics(record)
    assert set(metrics) == {"minipile_lastword", "minipile_continuation", "minipile_ppl"}
    assert {"acc", "perplexity"} <= set(metrics["minipile_lastword"])
    assert {"acc", "acc_norm"} <= set(metrics["minipile_continuation"])
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(metrics["minipile_ppl"])
    assert results["n-samples"]["minipile_continuation"]["effective"] == 4
    table = render(zero_shot_table([record]), "md")
    assert "Continuation (local)" in table and "Last word (local)" in table


def test_eval_command_with_a_checkpoint_loader(tmp_path, model, tokenizer, monkeypatch, no_network):
    checkpoint = tmp_path / "checkpoints"
    checkpoint.mkdir()
    loaded = []

    def fake_loader(checkpoint_dir, device=None):
        loaded.append(Path(checkpoint_dir))
        return model, tokenizer

    monkeypatch.setattr(harness, "load_scoring_model", fake_loader)
    # lm-eval's own construction path: registry name + argument string
    lm = get_model(MODEL_NAME).create_from_arg_string(
        f"checkpoint={checkpoint}", {"batch_size": "2", "max_batch_size": None, "device": None}
    )
    assert isinstance(lm, SuiteLM) and lm.batch_size == 2 and loaded == [checkpoint]

    out = tmp_path / "eval.json"
    argv = ["eval", "--checkpoint", str(checkpoint), "--local-tasks", str(tmp_path / "tasks"),
            "--local-tasks-from", str(_heldout(tmp_path / "heldout.jsonl")), "--tasks", "minipile_continuation",
            "--limit", "3", "--bootstrap-iters", "0", "--out", str(out)]
    assert repro_main(argv) == 0
    written = json.loads(out.read_text())
    assert set(written["results"]) == {"minipile_continuation"}
    assert "acc_norm,none" in written["results"]["minipile_continuation"]


def test_eval_errors_are_one_line(tmp_path, capsys):
    assert repro_main(["eval", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "o.json")]) == 2
    assert f"{tmp_path / 'missing'}: no checkpoint found" in capsys.readouterr().err
    with pytest.raises(ReproError, match="either checkpoint=DIR or model="):
        SuiteLM()


def test_missing_hub_data_and_unknown_tasks_are_clear_errors(model, tokenizer, tmp_path, monkeypatch, no_network):
    import datasets
    import huggingface_hub

    # empty caches, so the result does not depend on what this machine happens to have cached
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    lm = SuiteLM(model=model, tokenizer=tokenizer)
    manager = task_manager_for(["arc_easy"], None)  # indexing lm-eval's own tasks takes seconds: once
    with pytest.raises(ReproError, match="not available offline"):
        evaluate_lm(lm, ["arc_easy"], task_manager=manager, limit=1)
    with pytest.raises(ReproError, match="unknown lm-eval task"):
        evaluate_lm(lm, ["no_such_task"], task_manager=manager, limit=1)


# ----------------------------------------------------------------------- the papers' tasks from a task-data folder
TASKS_DATA = Path(__file__).parent / "fixtures" / "tasks_data"
FIXTURE_DOCS = {"arc_challenge": 6, "arc_easy": 6, "boolq": 6, "hellaswag": 6, "lambada_openai": 6, "piqa": 6, "race": 4}


def test_the_seven_tasks_run_offline_from_a_task_data_folder(model, tokenizer, tmp_path, no_network):
    from lm_eval.api.metrics import mean_stderr

    from repro.evaluation.runner import FULL_SCALE_TASKS
    from repro.stats import compact_per_question, per_question_scores

    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=4)
    results = evaluate_lm(lm, tasks_data=TASKS_DATA, log_samples=True)
    assert set(results["results"]) == set(FULL_SCALE_TASKS) == set(FIXTURE_DOCS)
    assert {t: n["effective"] for t, n in results["n-samples"].items()} == FIXTURE_DOCS
    for task, config in results["configs"].items():  # lm-eval's own task definition, reading the local folder
        assert Path(config["dataset_path"]).is_relative_to(TASKS_DATA.resolve()), task
    assert results["configs"]["race"]["dataset_name"] == "high"
    assert results["configs"]["hellaswag"]["process_docs"]  # lm-eval's preprocessing, from its installed utils.py
    for metric in ("acc", "acc_norm"):
        for task, scores in per_question_scores(results["samples"], metric).items():
            assert all(s in (0.0, 1.0) for s in scores.scores)
            numbers = results["results"][task]
            assert numbers[f"{metric},none"] == pytest.approx(sum(scores.scores) / len(scores.scores))
            # lm-eval's +- for an accuracy is the closed-form standard error over the questions
            assert numbers[f"{metric}_stderr,none"] == pytest.approx(mean_stderr(scores.scores))
    compact = compact_per_question(results["samples"])
    assert {t: len(v["acc"]) for t, v in compact.items()} == FIXTURE_DOCS
    assert "acc_norm" not in compact["boolq"] and "acc_norm" in compact["piqa"]


def test_task_data_with_local_tasks_and_missing_data(model, tokenizer, tmp_path, no_network):
    local = build_local_tasks(_heldout(tmp_path / "heldout.jsonl"), tmp_path / "tasks")
    lm = SuiteLM(model=model, tokenizer=tokenizer, batch_size=4)
    results = evaluate_lm(lm, ["piqa", "minipile_continuation"], local_tasks=local, tasks_data=TASKS_DATA,
                          limit=3, bootstrap_iters=0)
    assert set(results["results"]) == {"piqa", "minipile_continuation"}
    assert results["results"]["piqa"]["acc_stderr,none"] == "N/A"  # bootstrap_iters=0: no standard errors
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReproError, match=f"task 'piqa': no baber/piqa in {empty}.*task 'race': no EleutherAI/race"):
        evaluate_lm(lm, ["piqa", "race"], tasks_data=empty)
