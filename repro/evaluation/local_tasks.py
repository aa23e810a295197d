"""Local lm-eval tasks over the mini-pile's held-out documents, for the embedded default (no Hub access).

:func:`build_local_tasks` makes three tasks from a held-out Pile file (``python -m repro eval --local-tasks DIR``):

- ``minipile_lastword`` (LAMBADA-style): log-likelihood of a passage's final word; ``acc`` (greedy) and ``perplexity``.
- ``minipile_continuation`` (HellaSwag-style): the true continuation against distractors from other documents
  at the same offset (distinct, seeded); ``acc`` and ``acc_norm`` (per character).
- ``minipile_ppl``: rolling log-likelihood of each document's start; word/byte perplexity, bits per byte.

All are tagged ``minipile``; data and datasets cache stay inside the directory. Whitespace is normalised.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from repro.errors import ReproError
from repro.io_utils import atomic_path, check_output_path

LOCAL_TAG = "minipile"
#: Column labels of the local tasks in the zero-shot table.
LOCAL_TASK_LABELS: dict[str, str] = {"minipile_lastword": "Last word (local)",
                                     "minipile_continuation": "Continuation (local)",
                                     "minipile_ppl": "Perplexity (local)"}
_TRAILING_PUNCT = ".,;:!?\"')]}*"
_MANIFEST = "manifest.json"
_HF_CACHE = ".hf_cache"
# Anything else in a local-task directory makes it someone else's.
_TASK_DIR_ENTRIES = {_MANIFEST, _HF_CACHE, *(f"{t}.{ext}" for t in LOCAL_TASK_LABELS for ext in ("yaml", "jsonl"))}


def is_local_tasks_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory :func:`build_local_tasks` wrote (manifest and task files only)."""
    path = Path(path)
    try:
        entries = {p.name for p in path.iterdir()}
        manifest = json.loads((path / _MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and {"heldout", "tasks"} <= set(manifest) and entries <= _TASK_DIR_ENTRIES


@dataclass(frozen=True)
class LocalTaskOptions:
    """How the local tasks are cut from the held-out documents (lengths in words).

    Args:
        max_docs: held-out documents used (a seeded sample, in file order, if there are more).
        lastword_max_words / lastword_min_words: longest / shortest passage before the final word.
        context_words / continuation_words: the continuation task's passage / each choice.
        num_choices, ppl_words: choices per question (one true); words per document scored by ``minipile_ppl``.
        windows_per_doc, seed: most questions (consecutive windows) per document; seeds distractors and order.
    """

    max_docs: int = 500
    lastword_max_words: int = 64
    lastword_min_words: int = 16
    context_words: int = 48
    continuation_words: int = 12
    num_choices: int = 4
    ppl_words: int = 256
    windows_per_doc: int = 8
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.num_choices < 2:
            raise ValueError(f"num_choices must be >= 2, got {self.num_choices}")
        if not 1 <= self.lastword_min_words <= self.lastword_max_words:
            raise ValueError("need 1 <= lastword_min_words <= lastword_max_words")
        if min(self.max_docs, self.context_words, self.continuation_words, self.ppl_words, self.windows_per_doc) < 1:
            raise ValueError("max_docs, context_words, continuation_words, ppl_words and windows_per_doc must be >= 1")


def _windows(words: list[str], size: int, count: int) -> list[list[str]]:
    """Up to ``count`` consecutive windows of ``size`` words (the last may be shorter)."""
    return [words[i : i + size] for i in range(0, len(words), size)][:count]


def _lastword_docs(docs: list[dict[str, str]], opts: LocalTaskOptions) -> list[dict[str, Any]]:
    out = []
    for doc in docs:
        for words in _windows(doc["text"].split(" "), opts.lastword_max_words + 1, opts.windows_per_doc):
            # The longest allowed passage ending before a clean target.
            for end in range(min(len(words) - 1, opts.lastword_max_words), opts.lastword_min_words - 1, -1):
                target = words[end].rstrip(_TRAILING_PUNCT)  # a LAMBADA-like target: alphabetic, >= 2 letters
                if len(target) >= 2 and target.isalpha():
                    out.append({"context": " ".join(words[:end]), "target": " " + target, "domain": doc["domain"]})
                    break
    return out


def _continuation_docs(docs: list[dict[str, str]], opts: LocalTaskOptions) -> list[dict[str, Any]]:
    span = opts.context_words + opts.continuation_words
    pieces, owners = [], []
    for index, doc in enumerate(docs):
        for words in _windows(doc["text"].split(" "), span, opts.windows_per_doc):
            if len(words) == span:
                pieces.append(words)
                owners.append(index)
    continuations = [" ".join(w[opts.context_words : span]) for w in pieces]
    # Distinct texts (a distractor equal to the truth is unanswerable), drawn from other documents only.
    pool = sorted(set(continuations))
    if len(pool) < opts.num_choices:
        raise ReproError(f"the continuation task needs at least {opts.num_choices} held-out windows of {span} "
                         f"words with distinct continuations, found {len(pool)}")
    sources: dict[str, set[int]] = {}
    for text, owner in zip(continuations, owners):
        sources.setdefault(text, set()).add(owner)
    rng = random.Random(opts.seed)
    out = []
    for words, true, owner in zip(pieces, continuations, owners):
        candidates = [c for c in pool if c != true and owner not in sources[c]]
        if len(candidates) < opts.num_choices - 1:
            raise ReproError(f"the continuation task needs {opts.num_choices - 1} distractors from other held-out "
                             f"documents, found {len(candidates)}")
        choices = [true] + rng.sample(candidates, opts.num_choices - 1)
        order = list(range(opts.num_choices))
        rng.shuffle(order)
        out.append({"context": " ".join(words[: opts.context_words]), "choices": [choices[k] for k in order],
                    "label": order.index(0), "domain": docs[owner]["domain"]})
    return out


def build_local_tasks(heldout_jsonl: str | Path, out_dir: str | Path, options: LocalTaskOptions | None = None) -> Path:
    """Write the local tasks' data and YAMLs for lm-eval.

    Args:
        heldout_jsonl: held-out documents in Pile format (``.jsonl`` or ``.jsonl.zst``).
        out_dir: the task directory; replaced atomically only if :func:`is_local_tasks_dir`.

    Returns:
        ``out_dir`` absolute, for ``TaskManager(include_path=...)``.

    Raises:
        ReproError: a bad held-out file, too few documents for a task, or a foreign ``out_dir``.
    """
    opts = options or LocalTaskOptions()
    source = Path(heldout_jsonl).resolve()
    # Not resolved: a symlink at ``out_dir`` is refused, never followed.
    final = Path(os.path.abspath(out_dir))
    check_output_path(final, replace=is_local_tasks_dir)
    from repro.data.pile import iter_pile_documents

    docs = [{"text": " ".join(text.split()), "domain": domain}
            for text, domain in iter_pile_documents([source], default_domain="unknown")]
    if len(docs) > opts.max_docs:  # a seeded sample of the whole file: it may be grouped by domain
        docs = [docs[i] for i in sorted(random.Random(opts.seed).sample(range(len(docs)), opts.max_docs))]
    # name: (rows, output_type, doc_to_text, doc_to_choice (None: not a multiple-choice task), doc_to_target,
    # (metric, aggregation, higher_is_better) ...)
    ppl_docs = [{"text": " ".join(d["text"].split(" ")[: opts.ppl_words]), "domain": d["domain"]}
                for d in docs if d["text"]]
    tasks = {
        "minipile_lastword": (_lastword_docs(docs, opts), "loglikelihood", "{{context}}", None, "{{target}}",
                              ("perplexity", "perplexity", False), ("acc", "mean", True)),
        "minipile_continuation": (_continuation_docs(docs, opts), "multiple_choice", "{{context}}", "choices", "label",
                                  ("acc", "mean", True), ("acc_norm", "mean", True)),
        "minipile_ppl": (ppl_docs, "loglikelihood_rolling", "", None, "{{text}}",
                         ("word_perplexity", "weighted_perplexity", False),
                         ("byte_perplexity", "weighted_perplexity", False), ("bits_per_byte", "bits_per_byte", False)),
    }
    for name, (rows, *_) in tasks.items():
        if not rows:
            raise ReproError(f"{source}: no held-out document is long enough for task '{name}'")
    with atomic_path(final, replace=is_local_tasks_dir) as tmp:
        tmp.mkdir()
        for name, (rows, output_type, text, choice, target, *metrics) in tasks.items():
            data_name = f"{name}.jsonl"
            (tmp / data_name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            # Final paths: the temporary directory is renamed onto it.
            files = {"data_files": {"test": str(final / data_name)}, "cache_dir": str(final / _HF_CACHE)}
            config = {"task": name, "tag": [LOCAL_TAG], "dataset_path": "json", "dataset_kwargs": files,
                      "test_split": "test", "output_type": output_type, "doc_to_text": text,
                      **({} if choice is None else {"doc_to_choice": choice}), "doc_to_target": target,
                      "metric_list": [{"metric": m, "aggregation": a, "higher_is_better": h} for m, a, h in metrics],
                      "metadata": {"version": 1.0}}
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        manifest = {"heldout": str(source), "heldout_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
                    "documents_used": len(docs), "tasks": {name: len(rows) for name, (rows, *_) in tasks.items()},
                    "options": asdict(opts)}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return final
