"""``python -m repro data ...``: build the mini-pile, or tokenise Pile shards into an indexed dataset.

    python -m repro data mini-pile --out DIR [--max-mb-per-domain 2] [--vocab-size 8192] [--seed 1234]
    python -m repro data tokenize --input SHARD... --vocab vocab.json --merges merges.txt --out PREFIX
    python -m repro data token-counts --prefix PREFIX      # for Hash's balanced table (counts_path)
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from repro.errors import ReproError
from routers.registry import quiet_megatron_import


def _mini_pile(args: argparse.Namespace) -> int:
    from repro.data.minipile import MiniPileConfig, build_mini_pile

    config = MiniPileConfig(max_bytes_per_domain=int(args.max_mb_per_domain * 1e6),
                            heldout_fraction=args.heldout_fraction, vocab_size=args.vocab_size, num_shards=args.shards,
                            seed=args.seed, domains=tuple(args.domains) if args.domains else None)
    mini = build_mini_pile(args.out, config, num_workers=args.workers, force=args.force,
                           progress=not args.no_progress, log=print)
    fields = ("documents", "bytes", "tokens", "heldout_documents", "heldout_tokens")
    values = {name: [getattr(mini.stats[name], f) for f in fields] for name in mini.domains}
    values["total"] = [sum(v[i] for v in values.values()) for i in range(len(fields))]
    rows = [("domain", "docs", "MB", "tokens", "held-out docs", "held-out tokens")]
    rows += [(name, str(d), f"{b / 1e6:.2f}", f"{t:,}", str(hd), f"{ht:,}")
             for name, (d, b, t, hd, ht) in values.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for name, why in mini.skipped_domains.items():
        print(f"skipped domain {name}: {why}")
    rate = f"{mini.tokenize_tokens_per_second:,.0f} tokens/s"
    print(f"reused from cache in {mini.build_seconds:.1f} s (tokenisation when built: {rate})" if mini.reused
          else f"built in {mini.build_seconds:.1f} s; tokenisation {rate}")
    print(f"train prefix:   {mini.train_prefix}")
    print(f"held-out:       {mini.heldout_path} (indexed: {mini.heldout_prefix})")
    print(f"tokenizer:      {mini.vocab_path}, {mini.merges_path}")
    return 0


def _tokenizer_copies(out_dir: Path, vocab: Path, merges: Path) -> list[tuple[Path, Path]]:
    """``(source, destination)`` tokenizer files still to copy beside the output, checked before any work:
    identical files are skipped, anything else there is a ReproError (never written through a link)."""
    copies = []
    for src, name in ((vocab, "vocab.json"), (merges, "merges.txt")):
        dst = out_dir / name
        if dst.is_symlink():
            if not (dst.is_file() and dst.read_bytes() == src.read_bytes()):
                raise ReproError(f"{dst}: is a symbolic link (to {os.readlink(dst)}) and not to this tokenizer's "
                                 "file; refusing to write through it or replace it")
        elif dst.exists():
            if not dst.is_file():
                raise ReproError(f"{dst}: exists and is not a regular file; tokenize into another directory")
            if dst.read_bytes() != src.read_bytes():
                raise ReproError(f"{dst}: another tokenizer's file is already there; tokenize into another directory")
        else:
            copies.append((src, dst))
    return copies


def _tokenize(args: argparse.Namespace) -> int:
    from repro.data.tokenizer import load_tokenizer
    from repro.io_utils import atomic_path

    with quiet_megatron_import():
        from repro.data.indexed import tokenize_shards

    t0 = time.perf_counter()
    tok = load_tokenizer(args.vocab, args.merges)
    out_dir = Path(args.out).parent
    copies = _tokenizer_copies(out_dir, Path(args.vocab), Path(args.merges))  # before writing anything
    stats = tokenize_shards(args.input, tok, args.out, num_workers=args.workers,
                            default_domain=args.default_domain, progress=not args.no_progress)
    print(f"{'domain':<24} {'docs':>10} {'MB':>10} {'tokens':>14}")
    for name in stats.documents:
        print(f"{name:<24} {stats.documents[name]:>10} {stats.bytes[name] / 1e6:>10.2f} {stats.tokens[name]:>14,}")
    print(f"{'total':<24} {stats.num_documents:>10} {sum(stats.bytes.values()) / 1e6:>10.2f} {stats.num_tokens:>14,}")
    print(f"wrote {stats.prefix}.bin/.idx (+ .domains.json/.npy) in {time.perf_counter() - t0:.1f} s; "
          f"{stats.tokens_per_second:,.0f} tokens/s")
    for src, dst in copies:
        # atomic_path checks the destination again (refusing a link planted meanwhile) and never follows one
        with atomic_path(dst, replace=lambda p, src=src: p.read_bytes() == src.read_bytes()) as tmp:
            shutil.copyfile(src, tmp)
    print(f"tokenizer:      {out_dir / 'vocab.json'}, {out_dir / 'merges.txt'}")
    return 0


def _token_counts(args: argparse.Namespace) -> int:
    from repro.data.token_counts import token_counts_file

    with quiet_megatron_import():
        print(token_counts_file(args.prefix, args.split))
    return 0


def main(argv: list[str], prog: str = "python -m repro data") -> int:
    """Run a data command (``argv``: the arguments after ``data``); returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description="Build the mini-pile or tokenise Pile shards.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("mini-pile", help="build (or reuse) the embedded corpus, its tokenizer and indexed data")
    p.add_argument("--out", required=True, help="output directory (cached: rebuilt only when inputs change)")
    p.add_argument("--max-mb-per-domain", type=float, default=2.0, help="text per domain in MB (default 2)")
    p.add_argument("--heldout-fraction", type=float, default=0.03, help="share of documents held out (default 0.03)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    p.add_argument("--shards", type=int, default=2, help="training shards to write (default 2)")
    p.add_argument("--seed", type=int, default=1234, help="selection/split seed (default 1234)")
    p.add_argument("--domains", nargs="+", help="use only these domains")
    p.add_argument("--workers", type=int, default=None, help="tokeniser threads (default: all cores)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_mini_pile)

    t = sub.add_parser("tokenize", help="tokenise Pile shards (*.jsonl.zst / *.jsonl) into PREFIX.bin/.idx")
    t.add_argument("--input", nargs="+", required=True, help="shards, read in the order given")
    t.add_argument("--vocab", required=True, help="GPT-2 vocab.json")
    t.add_argument("--merges", required=True, help="GPT-2 merges.txt")
    t.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin, .idx, .domains.json, .domains.npy)")
    t.add_argument("--workers", type=int, default=None, help="tokeniser threads (default: all cores)")
    t.add_argument("--default-domain", default=None, help="domain for records without meta.pile_set_name")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=_tokenize)

    c = sub.add_parser("token-counts", help="count the training tokens of indexed data (Hash's balanced table)")
    c.add_argument("--prefix", nargs="+", required=True, help="indexed-dataset prefix(es)")
    c.add_argument("--split", default="969,30,1", help="megatron's split; only training documents are counted")
    c.set_defaults(func=_token_counts)

    args = parser.parse_args(argv)
    return int(args.func(args))
