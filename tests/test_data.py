"""Data pipeline: Pile reader, GPT-2 BPE files, indexed datasets with domains, mini-pile, GPTDatasets."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch
import zstandard
from tokenizers.implementations import ByteLevelBPETokenizer

from repro import cli
from repro.data import minipile
from repro.data.datasets import build_datasets
from repro.data.indexed import load_domain_index, read_documents, tokenize_shards
from repro.data.minipile import MiniPileConfig, build_mini_pile, open_mini_pile
from repro.data.minipile_sources import ALL_DOMAINS, troff_to_text
from repro.data.pile import PileRecord, iter_pile_documents, write_pile_shard
from repro.data.tokenizer import EOD_TOKEN, load_tokenizer, train_bpe_tokenizer
from repro.errors import ReproError

DOCS = [
    PileRecord("def f(x):\n    return x + 1\n", "Github"),
    PileRecord("The quick brown fox jumps over the lazy dog.", "Pile-CC"),
    PileRecord("Unicode: naïve café, 東京, emoji \U0001f600 and <|endoftext|> as plain text.", "Wikipedia (en)"),
    PileRecord("", "Pile-CC"),  # an empty document still gets its EOD token
    PileRecord("Theorem 1. Every bounded monotone sequence converges.\n" * 3, "ArXiv"),
]

# A small mini-pile: 100 kB per domain, a small vocabulary; builds in a few seconds.
SMALL = MiniPileConfig(max_bytes_per_domain=100_000, vocab_size=1024)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    return build_mini_pile(tmp_path_factory.mktemp("minipile"), SMALL, num_workers=2)


@pytest.fixture(scope="module")
def tokenizer(mini):
    return mini.tokenizer()


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    """Files or temporary directories in ``directory`` other than ``keep``."""
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# ---- reader ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shard.jsonl.zst", "shard.jsonl"])
def test_pile_shard_round_trip(tmp_path, name):
    path = tmp_path / name
    assert write_pile_shard(path, DOCS) == len(DOCS)
    assert list(iter_pile_documents([path])) == DOCS


def test_reader_streams_concatenated_zstd_frames(tmp_path):
    a, b = tmp_path / "a.jsonl.zst", tmp_path / "b.jsonl.zst"
    write_pile_shard(a, DOCS[:2])
    write_pile_shard(b, DOCS[2:])
    both = tmp_path / "both.jsonl.zst"
    both.write_bytes(a.read_bytes() + b.read_bytes())  # what ``cat a.zst b.zst`` makes
    assert list(iter_pile_documents([both])) == DOCS
    assert list(iter_pile_documents([a, b])) == DOCS


def test_default_domain_for_records_without_meta(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n")
    assert list(iter_pile_documents([path], default_domain="misc")) == [PileRecord("hello", "misc")]
    with pytest.raises(ReproError, match=rf"{path}:1: .*pile_set_name"):
        list(iter_pile_documents([path]))


# ---- tokenizer -------------------------------------------------------------------------------------------


def test_trained_gpt2_files_reload_and_encode_identically(tmp_path):
    texts = [d.text for d in DOCS] * 20 + [Path(__file__).read_text()]
    vocab, merges = train_bpe_tokenizer(texts, tmp_path / "tok", vocab_size=600)
    assert vocab.name == "vocab.json" and merges.name == "merges.txt"
    assert merges.read_text().startswith("#version")  # GPT-2's merges format
    ours = load_tokenizer(vocab, merges)
    reference = ByteLevelBPETokenizer.from_file(str(vocab), str(merges))  # HF's own GPT-2-style loader
    assert ours.eod == json.loads(vocab.read_text())[EOD_TOKEN]
    assert ours.vocab_size == 600
    for text in texts[:5] + [texts[-1]]:
        ids = ours.tokenize(text)
        assert ids == reference.encode(text).ids
        assert ours.detokenize(ids) == text  # byte-level: exact round trip
    # the literal string is plain text, never the document separator
    assert ours.eod not in ours.tokenize("a <|endoftext|> b")


# ---- indexed dataset -------------------------------------------------------------------------------------


def test_documents_round_trip_through_indexed_dataset(tmp_path, tokenizer):
    shards = [tmp_path / "00.jsonl.zst", tmp_path / "01.jsonl"]
    write_pile_shard(shards[0], DOCS[:3])
    write_pile_shard(shards[1], DOCS[3:])
    stats = tokenize_shards(shards, tokenizer, tmp_path / "out" / "corpus", num_workers=2)
    prefix = str(tmp_path / "out" / "corpus")
    docs = list(read_documents(prefix))
    assert len(docs) == stats.num_documents == len(DOCS)
    assert sum(len(d) for d in docs) == stats.num_tokens
    domains = load_domain_index(prefix)
    for i, (record, ids) in enumerate(zip(DOCS, docs)):
        assert ids.tolist() == tokenizer.tokenize(record.text) + [tokenizer.eod]
        assert tokenizer.detokenize(ids[:-1]) == record.text
        assert domains.domain_of(i) == record.domain
    assert set(domains.names) == {d.domain for d in DOCS}
    assert stats.documents["Pile-CC"] == 2
    assert _leftovers(tmp_path / "out", {f"corpus{e}" for e in (".bin", ".idx", ".domains.json", ".domains.npy")}) == []


# ---- bad input -------------------------------------------------------------------------------------------


def _good_lines(n: int) -> str:
    return "".join(json.dumps({"text": f"document {i}", "meta": {"pile_set_name": "A"}}) + "\n" for i in range(n))


def _bad_input(kind: str, d: Path) -> tuple[Path, str]:
    """Write one bad shard; return it and a regex its error must match (file, and line where there is one)."""
    if kind == "missing":
        return d / "absent.jsonl.zst", r"absent\.jsonl\.zst: no such file"
    if kind == "truncated":
        p = d / "trunc.jsonl.zst"
        rng = random.Random(0)  # incompressible text, so the first half of the frame decodes to some lines
        records = ({"text": rng.randbytes(60).hex(), "meta": {"pile_set_name": "A"}} for _ in range(3000))
        lines = "".join(json.dumps(r) + "\n" for r in records)
        blob = zstandard.ZstdCompressor(write_checksum=True).compress(lines.encode())
        p.write_bytes(blob[: len(blob) // 2])
        return p, r"trunc\.jsonl\.zst: truncated zstd stream.*after line \d+"
    if kind == "corrupt":
        p = d / "corrupt.jsonl.zst"
        p.write_bytes(b"this is not a zstd frame at all" * 10)
        return p, r"corrupt\.jsonl\.zst: corrupt zstd stream"
    if kind == "not_json":
        p = d / "notjson.jsonl"
        p.write_text(_good_lines(2) + "{not json\n" + _good_lines(1))
        return p, r"notjson\.jsonl:3: not valid JSON"
    if kind == "no_text":
        p = d / "notext.jsonl.zst"
        write_pile_shard(p, [PileRecord("fine", "A")])
        raw = zstandard.ZstdDecompressor().stream_reader(p.read_bytes()).read()
        raw += (json.dumps({"meta": {"pile_set_name": "A"}}) + "\n").encode()
        p.write_bytes(zstandard.ZstdCompressor().compress(raw))
        return p, r"notext\.jsonl\.zst:2: record has no 'text'"
    if kind == "bad_utf8":
        p = d / "badutf8.jsonl"
        p.write_bytes(_good_lines(1).encode() + b'{"text": "caf\xe9", "meta": {"pile_set_name": "A"}}\n')
        return p, r"badutf8\.jsonl: not valid UTF-8"
    if kind == "empty":
        p = d / "empty.jsonl"
        p.write_text("\n")
        return p, r"empty\.jsonl: empty corpus"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "truncated", "corrupt", "not_json", "no_text", "bad_utf8", "empty"])
def test_bad_input_is_one_line_error_and_leaves_nothing(tmp_path, tokenizer, kind):
    inputs = tmp_path / "in"
    inputs.mkdir()
    shard, pattern = _bad_input(kind, inputs)
    out = tmp_path / "out"
    out.mkdir()
    # a good dataset already at the prefix must survive a failed rebuild untouched
    good = inputs / "good.jsonl"
    good.write_text(_good_lines(2))
    tokenize_shards([good], tokenizer, out / "ds")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ReproError, match=pattern) as info:
        tokenize_shards([good, shard] if kind != "empty" else [shard], tokenizer, out / "ds")
    assert "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary, no half-written file
    # nothing at a fresh prefix either
    with pytest.raises(ReproError):
        tokenize_shards([shard], tokenizer, out / "fresh")
    assert not any(p.name.startswith((".fresh", "fresh")) for p in out.iterdir())


def test_cli_reports_bad_input_as_one_line(tmp_path, tokenizer, capsys):
    shard, _ = _bad_input("not_json", tmp_path)
    args = ["data", "tokenize", "--input", str(shard), "--out", str(tmp_path / "x"), "--no-progress"]
    args += ["--vocab", str(tokenizer.vocab_path), "--merges", str(tokenizer.merges_path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "notjson.jsonl:3:" in err and "\n" not in err


@pytest.mark.parametrize(
    "which, content, pattern",
    [
        ("vocab", '{"a": 0,\n "b": }', r"vocab\.json:2: vocabulary is not valid JSON"),
        ("vocab", "[1, 2]", r"vocab\.json: vocabulary must be"),
        ("vocab", '{"a": 0, "b": 1}', r"vocab\.json: vocabulary has no end-of-document token"),
        ("merges", "#version: 0.2\nĠ t\nbroken-line-without-space\n", r"merges\.txt:3: a merge must be two tokens"),
        ("vocab", None, r"vocab\.json: no such file"),
    ],
)
def test_bad_vocabulary_files(tmp_path, tokenizer, which, content, pattern):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_bytes(tokenizer.vocab_path.read_bytes())
    merges.write_bytes(tokenizer.merges_path.read_bytes())
    target = vocab if which == "vocab" else merges
    if content is None:
        target.unlink()
    else:
        target.write_text(content)
    with pytest.raises(ReproError, match=pattern):
        load_tokenizer(vocab, merges)


# ---- mini-pile -------------------------------------------------------------------------------------------


def test_mini_pile_has_every_domain_and_a_clean_heldout(mini, tokenizer):
    assert len(mini.domains) >= 4
    assert set(mini.domains) | set(mini.skipped_domains) == set(ALL_DOMAINS)
    for name in ("python_code", "python_docstrings", "python_reference", "licenses"):
        assert name in mini.domains  # from the interpreter itself: always there
    for name in mini.domains:
        s = mini.stats[name]
        assert s.documents > 0 and s.tokens > s.documents and s.heldout_documents >= 1
        assert s.bytes + s.heldout_bytes <= SMALL.max_bytes_per_domain + SMALL.max_doc_bytes

    train = list(iter_pile_documents(mini.train_shards))
    heldout = list(iter_pile_documents([mini.heldout_path]))
    assert {d for _, d in train} == {d for _, d in heldout} == set(mini.domains)
    assert not {t for t, _ in train} & {t for t, _ in heldout}

    # the training prefix is exactly the training shards, and holds no held-out document
    train_docs = [tuple(ids.tolist()) for ids in read_documents(mini.train_prefix)]
    held_docs = [tuple(ids.tolist()) for ids in read_documents(mini.heldout_prefix)]
    assert len(train_docs) == len(train) and len(held_docs) == len(heldout)
    assert not set(train_docs) & set(held_docs)
    assert list(train_docs[0]) == tokenizer.tokenize(train[0].text) + [tokenizer.eod]
    index = load_domain_index(mini.train_prefix)
    assert [index.domain_of(i) for i in range(len(train))] == [d for _, d in train]


def test_mini_pile_is_cached_and_rebuilt_when_inputs_change(mini):
    again = build_mini_pile(mini.root, SMALL)
    assert again.reused and again.stats == mini.stats
    shard_bytes = [p.read_bytes() for p in mini.train_shards]
    manifest = json.loads((mini.root / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"corpus", "tokenizer", "indexed"}
    # another vocabulary size: the corpus is reused, tokenizer and indexed data rebuilt
    other = build_mini_pile(mini.root, dataclasses.replace(SMALL, vocab_size=700))
    assert not other.reused and other.tokenizer().vocab_size == 700
    assert [p.read_bytes() for p in other.train_shards] == shard_bytes  # deterministic, untouched
    # and back: rebuilt with the original vocabulary
    back = build_mini_pile(mini.root, SMALL)
    assert not back.reused and back.tokenizer().vocab_size == 1024 and back.stats == mini.stats


def test_a_built_mini_pile_opens_from_its_manifest_without_listing_the_sources(mini_pile, mini, tmp_path, monkeypatch):
    built = build_mini_pile(mini_pile)
    with monkeypatch.context() as patch:
        patch.setattr(minipile, "_list_sources", lambda cfg: pytest.fail("open_mini_pile listed the sources"))
        opened = open_mini_pile(mini_pile)
    assert dataclasses.replace(opened, build_seconds=0.0) == dataclasses.replace(built, build_seconds=0.0)
    # absent, built with another configuration, or incomplete: left to build_mini_pile
    builds = []
    monkeypatch.setattr(minipile, "build_mini_pile", lambda root: builds.append(Path(root)) or built)
    shards = tmp_path / "shards"
    shards.mkdir()
    for rel in json.loads((built.root / "manifest.json").read_text())["stages"]["corpus"]["files"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / "manifest.json").write_bytes((built.root / "manifest.json").read_bytes())
    for root in (tmp_path / "absent", mini.root, tmp_path):
        assert open_mini_pile(root) is built
    assert builds == [tmp_path / "absent", mini.root, tmp_path]


def test_mini_pile_is_deterministic(mini, tmp_path):
    twin = build_mini_pile(tmp_path / "twin", SMALL)
    for a, b in zip(
        [*mini.train_shards, mini.heldout_path, mini.vocab_path, mini.merges_path, Path(mini.train_prefix + ".bin")],
        [*twin.train_shards, twin.heldout_path, twin.vocab_path, twin.merges_path, Path(twin.train_prefix + ".bin")],
    ):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_mini_pile_needs_enough_domains(tmp_path):
    cfg = dataclasses.replace(SMALL, domains=("python_code", "python_reference"))
    with pytest.raises(ReproError, match=r"only 2 domain\(s\).*need at least 4"):
        build_mini_pile(tmp_path / "mp", cfg)
    assert not (tmp_path / "mp" / "shards").exists()


def test_troff_to_text():
    page = (
        '.\\" a comment\n.TH LS 1 "2022" "GNU" "User Commands"\n.SH NAME\nls \\- list directory contents\n'
        ".SH SYNOPSIS\n.B ls\n[\\fI\\,OPTION\\/\\fR]...\n.TP\n\\fB\\-a\\fR, \\fB\\-\\-all\\fR\n"
        ".BR ls (1)\n.de XX\nignored\n..\n"
    )
    text = troff_to_text(page)
    assert text.startswith("LS(1)\n\nNAME\nls - list directory contents")
    assert "[OPTION]..." in text and "-a, --all" in text and "ls(1)" in text
    assert "comment" not in text and "ignored" not in text and "\\" not in text
    assert troff_to_text(".so man1/other.1\n") is None


def test_cli_mini_pile_prints_sizes_and_throughput(mini, capsys):
    args = ["data", "mini-pile", "--out", str(mini.root), "--max-mb-per-domain", "0.1", "--vocab-size", "1024"]
    args.append("--no-progress")
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "reused from cache" in out and "tokens/s" in out
    for name in mini.domains:
        assert name in out


# ---- GPTDataset -------------------------------------------------------------------------------------------


def test_gpt_dataset_yields_corpus_samples(mini, tokenizer, tmp_path):
    seq, split = 64, "90,8,2"  # the small mini-pile has too few documents for the papers' 969,30,1
    train, valid, test = build_datasets(
        [mini.train_prefix], seq, (40, 8, 2), 1234, tmp_path / "cache", tokenizer, split=split
    )
    assert len(train) >= 40 and len(valid) >= 8 and len(test) >= 2
    b = train[0]
    assert set(b) == {"tokens", "labels", "loss_mask", "position_ids"}
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert b[key].shape == (seq,)
    assert b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.float32
    assert torch.equal(b["tokens"][1:], b["labels"][:-1])
    assert torch.equal(b["position_ids"], torch.arange(seq))
    assert int(b["tokens"].max()) < tokenizer.vocab_size

    # a fresh build with the same seed hits megatron's cache and gives the same samples
    again, _, _ = build_datasets([mini.train_prefix], seq, (40, 8, 2), 1234, tmp_path / "cache", tokenizer, split=split)
    assert torch.equal(again[5]["tokens"], train[5]["tokens"])


def test_blend_of_two_prefixes(mini, tokenizer, tmp_path):
    prefixes = [mini.train_prefix, mini.heldout_prefix]
    train, valid, test = build_datasets(prefixes, 32, (30, None, None), 7, tmp_path / "cache", tokenizer, split="1,0,0")
    assert valid is None and test is None and len(train) >= 30
    assert train[0]["tokens"].shape == (32,)
    assert [d.dataset_path for d in train.datasets] == prefixes
    assert set(train.dataset_index.tolist()) == {0, 1}  # samples drawn from both


def test_split_without_documents_is_an_error(mini, tokenizer, tmp_path):
    with pytest.raises(ReproError, match=r"heldout: split '969,30,1' leaves the (valid|test) split no document"):
        build_datasets([mini.heldout_prefix], 32, (10, 2, 1), 1, tmp_path / "cache", tokenizer)


def test_build_datasets_under_torch_distributed(mini, tokenizer, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        train, valid, _ = build_datasets(
            [mini.train_prefix], 32, (16, 4, 2), 3, tmp_path / "cache", tokenizer, split="90,8,2"
        )
        assert len(train) >= 16 and len(valid) >= 4
        assert os.listdir(tmp_path / "cache")  # rank 0 wrote megatron's index cache for the other ranks
        prefixes = [mini.train_prefix, mini.heldout_prefix]
        blended, _, _ = build_datasets(prefixes, 32, (16, None, None), 3, tmp_path / "cache", tokenizer, split="1,0,0")
        assert blended[0]["tokens"].shape == (32,)
    finally:
        dist.destroy_process_group()
