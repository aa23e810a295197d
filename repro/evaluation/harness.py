"""The lm-eval bridge: this suite's checkpoints (any router) as an lm-eval ``LM`` registered as ``dirmoe-bench``.

The bridge talks to the model through :class:`ScoringModel` (token ids in, next-token logits out) and a
tokenizer (a Hugging Face ``tokenizers.Tokenizer`` or one with ``tokenize``/``detokenize``), so it does not
depend on how the model is built; checkpoint loading is wired in one place, :func:`load_scoring_model`.

Scoring is batched and deterministic (eval mode, ``torch.inference_mode``). Batches are right-padded: in a
causal model pads after a row's end cannot change its scores, and no attention mask or position offsets are
needed. Only the positions a request scores get log-probabilities (a model whose ``logits`` takes ``start``
runs its output layer on those alone: most of a multiple-choice request is context). A model that couples the
tokens of a batch says so with ``batch_coupled = True`` (Expert Choice, capacity dropping) and is scored one
request at a time; Lory routes each row once on its prompt, given the prompt lengths. Context is truncated
from the left to ``max_length`` tokens, as lm-eval's HF backend does.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from repro.evaluation.offline import ensure_offline

ensure_offline()

import torch  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences  # noqa: E402

from repro.errors import ReproError  # noqa: E402

MODEL_NAME = "dirmoe-bench"
T = TypeVar("T")


@runtime_checkable
class ScoringModel(Protocol):
    """What the bridge needs from a trained model: ``eod_id`` (the prefix of an empty context, the stop
    token), ``max_length`` (its training sequence length) and :meth:`logits`; optionally ``device`` (where
    input ids go; default CPU) and ``eval()`` (called once, so routers run deterministically)."""

    eod_id: int
    max_length: int

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, S, V]`` for token ids ``[B, S]`` (position s predicts token s+1); optionally
        with ``start``: those of positions ``start..S-1`` alone, ``[B, S - start, V]``."""
        ...


def load_scoring_model(checkpoint_dir: str | Path, device: str | None = None) -> tuple[ScoringModel, Any]:
    """Load a checkpoint of this suite for evaluation (the one place where checkpoint loading is wired).

    Args:
        checkpoint_dir: a checkpoint directory written by the training loop.
        device: where to put the model (None: the loader's default).

    Returns:
        ``(model, tokenizer)`` from ``repro.training.inference.load_for_evaluation``.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ReproError(f"{path}: no such checkpoint directory")
    from repro.training.inference import load_for_evaluation

    return load_for_evaluation(path, device=device)


def _batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@register_model(MODEL_NAME)
class SuiteLM(TemplateLM):
    """The suite's lm-eval ``LM`` (``dirmoe-bench``): any checkpoint of the suite, whatever its router, from a
    checkpoint (``lm_eval --model dirmoe-bench --model_args checkpoint=DIR``, :meth:`from_checkpoint`) or from
    objects (``SuiteLM(model=..., tokenizer=...)``).

    Args:
        checkpoint: a checkpoint directory (loaded by :func:`load_scoring_model`).
        model: a :class:`ScoringModel` (instead of ``checkpoint``).
        tokenizer: a ``tokenizers.Tokenizer`` or a tokenizer with ``tokenize`` / ``detokenize`` (with ``model``).
        batch_size: sequences per forward pass (lm-eval passes it, possibly as a string; ``auto`` means 8).
        max_length: override of the model's ``max_length`` (never longer than it).
        max_gen_toks: default cap of generated tokens for ``generate_until``.
        device: passed to the checkpoint loader.
        max_batch_size: accepted for lm-eval's interface, unused.
    """

    def __init__(
        self, checkpoint: str | None = None, *, model: ScoringModel | None = None, tokenizer: Any = None,
        batch_size: int | str | None = 8, max_length: int | str | None = None, max_gen_toks: int | str = 256,
        device: str | None = None, max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if (checkpoint is None) == (model is None):
            raise ReproError("give either checkpoint=DIR or model= and tokenizer=, not both or neither")
        if checkpoint is not None:
            model, tokenizer = load_scoring_model(checkpoint, device=device)
        if tokenizer is None:
            raise ReproError("a model needs its tokenizer (tokenizer=)")
        if not isinstance(model, ScoringModel):
            raise ReproError(f"{type(model).__name__} is not a ScoringModel (needs eod_id, max_length, logits())")
        if hasattr(model, "eval"):
            model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self._device = torch.device(getattr(model, "device", None) or "cpu")
        self.batch_size = 8 if batch_size in (None, "auto") else int(batch_size)
        if self.batch_size < 1:
            raise ReproError(f"batch_size must be >= 1, got {self.batch_size}")
        if getattr(model, "batch_coupled", False):
            # Its routing of one request would depend on the others (and on padding) in the batch.
            self.batch_size = 1
        # Models that route on the prompt (Lory) take the prompt length of every row; models taking ``start``
        # compute the logits of the scored positions alone.
        parameters = inspect.signature(model.logits).parameters
        self._takes_prompt_lengths = "prompt_lengths_B" in parameters
        self._takes_start = "start" in parameters
        self._max_length = int(model.max_length) if max_length is None else min(int(max_length), int(model.max_length))
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, **kwargs: Any) -> SuiteLM:
        """Build the LM from a checkpoint directory (``kwargs``: the other constructor arguments)."""
        return cls(checkpoint=str(checkpoint_dir), **kwargs)

    # ------------------------------------------------------------------ tokenisation
    @property
    def eot_token_id(self) -> int:
        return int(self.model.eod_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return MODEL_NAME

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` (the GPT-2-format tokenizer adds no special tokens)."""
        if hasattr(self.tokenizer, "tokenize"):  # megatron-style wrapper (repro.data.tokenizer)
            return list(self.tokenizer.tokenize(string))
        return list(self.tokenizer.encode(string, add_special_tokens=False).ids)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        """Text of ``tokens``."""
        if hasattr(self.tokenizer, "detokenize"):
            return self.tokenizer.detokenize(list(tokens))
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ------------------------------------------------------------------ scoring core
    @torch.inference_mode()
    def _log_probs(
        self, sequences: Sequence[Sequence[int]], scored: Sequence[int], prompt_lengths: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Next-token log-probabilities ``[n, V]`` (float32) of the last ``n = scored[row]`` positions of each
        sequence, from one right-padded forward (``prompt_lengths``: the context tokens of each row, for models
        that route on the prompt)."""
        width = max(len(s) for s in sequences)
        tokens = torch.full((len(sequences), width), self.eot_token_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        start = min(len(seq) - n for seq, n in zip(sequences, scored))  # the first position any row scores
        kwargs: dict[str, Any] = {"start": start} if self._takes_start else {}
        if self._takes_prompt_lengths and prompt_lengths is not None:
            kwargs["prompt_lengths_B"] = list(prompt_lengths)
        logits = self.model.logits(tokens.to(self._device), **kwargs)
        if not self._takes_start:
            logits = logits[:, start:]
        if logits.shape[:2] != (len(sequences), width - start):
            raise ReproError(
                f"model returned logits {tuple(logits.shape)} for positions {start}.. of tokens {tuple(tokens.shape)}"
            )
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        ends = [len(seq) - start for seq in sequences]
        return [log_probs[row, end - n : end] for row, (end, n) in enumerate(zip(ends, scored))]

    def _loglikelihood_tokens(
        self, requests: Sequence[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """Score ``((context, continuation) or None, context_ids, continuation_ids)`` requests.

        Returns:
            ``(sum of log-probabilities, whether every continuation token is the greedy one)`` per request.
        """
        inputs, targets = [], []
        for pair, context, continuation in requests:
            if not continuation:
                raise ReproError(f"empty continuation to score (request {pair!r})")
            # A continuation longer than the model's window is scored on its last max_length tokens, the
            # context cut from the left, as lm-eval's own HF model does (the first tokens get no score).
            context = list(context) or [self.prefix_token_id]  # something must predict the first token
            whole = (context + list(continuation))[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            targets.append(list(continuation)[-self.max_length :])
        # Longest first: batches of similar lengths pad little; ties broken by content for a fixed order.
        order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i]), inputs[i]))
        results: list[tuple[float, bool] | None] = [None] * len(inputs)
        for batch in _batches(order, override_bs or self.batch_size):
            # The context is what precedes the scored tokens (at least the first input token).
            prompts = [max(1, len(inputs[i]) + 1 - len(targets[i])) for i in batch]
            # The last positions predict the continuation tokens.
            log_probs = self._log_probs([inputs[i] for i in batch], [len(targets[i]) for i in batch], prompts)
            for i, scored in zip(batch, log_probs):
                target = torch.tensor(targets[i], dtype=torch.long)
                total = float(scored.gather(-1, target[:, None]).sum())
                greedy = bool((scored.argmax(-1) == target).all())
                results[i] = (total, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ lm-eval request types
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of each request's string (``args == (string,)``) in windows of ``max_length``
        tokens, each token predicted once."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (string,) = request.args
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_likelihood, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += log_likelihood
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    @torch.inference_mode()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy generation (``args == (context, gen_kwargs)``) until a stop string, the end-of-document token
        or ``max_gen_toks``, cut before the first stop string; sampling is refused (greedy only)."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        outputs: list[str] = [""] * len(requests)
        eos_text = self.tok_decode([self.eot_token_id])
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            if kwargs.get("do_sample"):
                raise ReproError("generate_until: the dirmoe-bench bridge decodes greedily only (do_sample=True asked)")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            if max_new >= self.max_length:
                raise ReproError(f"max_gen_toks {max_new} must be below max_length {self.max_length}")
            contexts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new) :] for i in indices}
            by_length = sorted(indices, key=lambda i: -len(contexts[i]))
            for batch in _batches(by_length, self.batch_size):
                for i, text in zip(batch, self._greedy([contexts[i] for i in batch], until, max_new)):
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs

    def _greedy(self, contexts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy-decode a batch: re-run the (right-padded) sequences, read each row's last position."""
        if any(not c for c in contexts):
            contexts = [c or [self.prefix_token_id] for c in contexts]
        generated: list[list[int]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        for _ in range(max_new):
            if not active:
                break
            log_probs = self._log_probs(
                [contexts[i] + generated[i] for i in active], [1] * len(active), [len(contexts[i]) for i in active]
            )
            still = []
            for i, lp in zip(active, log_probs):
                token = int(lp[-1].argmax())
                if token == self.eot_token_id:
                    continue
                generated[i].append(token)
                if not any(stop in self.tok_decode(generated[i]) for stop in until):
                    still.append(i)
            active = still
        texts = []
        for tokens in generated:
            text = self.tok_decode(tokens)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts
