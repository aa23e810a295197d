"""The lm-eval bridge: this suite's checkpoints (any router) as an lm-eval ``LM`` registered as ``dirmoe-bench``.

It needs only a :class:`ScoringModel` and a tokenizer; checkpoint loading is in :func:`load_scoring_model`.
Scoring is batched and deterministic (eval mode, ``torch.inference_mode``), right-padded (in a causal model
trailing pads cannot change a row's scores, so no mask is needed), and only scored positions get
log-probabilities. ``batch_coupled`` models (Expert Choice, capacity dropping) are scored one request at a time;
Lory gets prompt lengths. Context is truncated from the left to ``max_length``, as lm-eval's HF backend does.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from repro.evaluation.offline import ensure_offline

ensure_offline()

import torch  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences  # noqa: E402

from repro.errors import ReproError  # noqa: E402

MODEL_NAME = "dirmoe-bench"


@runtime_checkable
class ScoringModel(Protocol):
    """What the bridge needs: ``eod_id`` (empty-context prefix, stop token), ``max_length`` (training sequence
    length), :meth:`logits`; optionally ``device`` (default CPU) and ``eval()`` (called once)."""

    eod_id: int
    max_length: int

    def logits(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, S, V]`` for ids ``[B, S]``; with optional ``start``: ``[B, S - start, V]``."""
        ...


def load_scoring_model(checkpoint_dir: str | Path, device: str | None = None) -> tuple[ScoringModel, Any]:
    """``(model, tokenizer)`` of a checkpoint, its ``checkpoints`` or run directory, on ``device`` (None: the
    default) by :func:`repro.training.inference.load_for_evaluation`."""
    from repro.training.inference import load_for_evaluation

    return load_for_evaluation(checkpoint_dir, device=device)


@register_model(MODEL_NAME)
class SuiteLM(TemplateLM):
    """The suite's lm-eval ``LM`` (``--model dirmoe-bench --model_args checkpoint=DIR``), or from objects.

    Args:
        checkpoint, model, tokenizer: a checkpoint directory (:func:`load_scoring_model`), or a
            :class:`ScoringModel` and its tokenizer.
        batch_size: sequences per forward pass (may be a string; ``auto``: 8).
        max_length: cap on the model's ``max_length``.
        max_gen_toks: default cap of generated tokens for ``generate_until``.
        device, max_batch_size: passed to the checkpoint loader; unused (lm-eval interface).
    """

    def __init__(self, checkpoint: str | None = None, *, model: ScoringModel | None = None, tokenizer: Any = None,
                 batch_size: int | str | None = 8, max_length: int | str | None = None, max_gen_toks: int | str = 256,
                 device: str | None = None, max_batch_size: int | None = None) -> None:
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
        self.model, self.tokenizer = model, tokenizer
        self._device = torch.device(getattr(model, "device", None) or "cpu")
        self.batch_size = 8 if batch_size in (None, "auto") else int(batch_size)
        if self.batch_size < 1:
            raise ReproError(f"batch_size must be >= 1, got {self.batch_size}")
        if getattr(model, "batch_coupled", False):
            # Its routing of one request would depend on the rest of the batch.
            self.batch_size = 1
        # Optional logits() arguments: prompt lengths (Lory routes on the prompt) and ``start``.
        parameters = inspect.signature(model.logits).parameters
        self._takes_prompt_lengths = "prompt_lengths_B" in parameters
        self._takes_start = "start" in parameters
        self._max_length = int(model.max_length) if max_length is None else min(int(max_length), int(model.max_length))
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, **kwargs: Any) -> SuiteLM:
        return cls(checkpoint=str(checkpoint_dir), **kwargs)

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
        """Token ids of ``string`` (no special tokens)."""
        if hasattr(self.tokenizer, "tokenize"):  # megatron-style wrapper (repro.data.tokenizer)
            return list(self.tokenizer.tokenize(string))
        return list(self.tokenizer.encode(string, add_special_tokens=False).ids)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        if hasattr(self.tokenizer, "detokenize"):
            return self.tokenizer.detokenize(list(tokens))
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    @torch.inference_mode()
    def _log_probs(self, sequences: Sequence[Sequence[int]], scored: Sequence[int],
                   prompt_lengths: Sequence[int]) -> list[torch.Tensor]:
        """Float32 log-probabilities ``[n, V]`` of each row's last ``n = scored[row]`` positions, one forward."""
        tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(seq, dtype=torch.long) for seq in sequences],
                                                 batch_first=True, padding_value=self.eot_token_id)
        start = min(len(seq) - n for seq, n in zip(sequences, scored))  # the first position any row scores
        kwargs: dict[str, Any] = {"start": start} if self._takes_start else {}
        if self._takes_prompt_lengths:
            kwargs["prompt_lengths_B"] = list(prompt_lengths)
        logits = self.model.logits(tokens.to(self._device), **kwargs)
        if not self._takes_start:
            logits = logits[:, start:]
        if logits.shape[:2] != (len(sequences), tokens.shape[1] - start):
            raise ReproError(f"model returned logits {tuple(logits.shape)} for positions {start}.. of tokens "
                             f"{tuple(tokens.shape)}")
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        ends = [len(seq) - start for seq in sequences]
        return [log_probs[row, end - n : end] for row, (end, n) in enumerate(zip(ends, scored))]

    def _loglikelihood_tokens(self, requests: Sequence[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, override_bs: int | None = None) -> list[tuple[float, bool]]:
        """Score ``((context, continuation) or None, context_ids, continuation_ids)`` requests.

        Returns:
            ``(sum of log-probabilities, whether every continuation token is the greedy one)`` per request.
        """
        inputs, targets = [], []
        for pair, context, continuation in requests:
            if not continuation:
                raise ReproError(f"empty continuation to score (request {pair!r})")
            # Beyond the window: keep the last max_length tokens (context cut first), as lm-eval's HF model does.
            context = list(context) or [self.prefix_token_id]  # something must predict the first token
            whole = (context + list(continuation))[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            targets.append(list(continuation)[-self.max_length :])
        # Longest first: batches of similar lengths pad little; ties broken by content for a fixed order.
        order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i]), inputs[i]))
        results: list[tuple[float, bool] | None] = [None] * len(inputs)
        size = override_bs or self.batch_size
        for batch in (order[k : k + size] for k in range(0, len(order), size)):
            # Prompt length: the tokens before the scored ones (at least one).
            prompts = [max(1, len(inputs[i]) + 1 - len(targets[i])) for i in batch]
            log_probs = self._log_probs([inputs[i] for i in batch], [len(targets[i]) for i in batch], prompts)
            for i, scored in zip(batch, log_probs):
                target = torch.tensor(targets[i], dtype=torch.long)
                total = float(scored.gather(-1, target[:, None]).sum())
                greedy = bool((scored.argmax(-1) == target).all())
                results[i] = (total, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of each string in disjoint ``max_length`` windows (each token scored once)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (string,) = request.args
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
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
        """Greedy generation until a stop string, EOD or ``max_gen_toks``, cut before the stop; no sampling."""
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
            for batch in (by_length[k : k + self.batch_size] for k in range(0, len(by_length), self.batch_size)):
                for i, text in zip(batch, self._greedy([contexts[i] for i in batch], until, max_new)):
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs

    def _greedy(self, contexts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy-decode a batch by re-running the right-padded sequences each step."""
        contexts = [c or [self.prefix_token_id] for c in contexts]
        generated: list[list[int]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        for _ in range(max_new):
            if not active:
                break
            log_probs = self._log_probs([contexts[i] + generated[i] for i in active], [1] * len(active),
                                        [len(contexts[i]) for i in active])
            still = []
            for i, lp in zip(active, log_probs):
                token = int(lp[-1].argmax())
                if token == self.eot_token_id:
                    continue
                generated[i].append(token)
                if not any(stop in self.tok_decode(generated[i]) for stop in until):
                    still.append(i)
            active = still
        texts = [self.tok_decode(tokens) for tokens in generated]
        for stop in filter(None, until):
            texts = [text.split(stop)[0] for text in texts]
        return texts
