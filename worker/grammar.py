"""Grammars enforced token by token (structured outputs and tool calls): one llguidance matcher per
constrained row, which says before each step which tokens may come next and is told the one chosen.
Only that row's logits are masked, so constrained and free rows share a batch unchanged."""

from __future__ import annotations

import threading

import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer
from transformers import PreTrainedTokenizerBase

from common.grammar import GrammarError

_BITS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Matchers over one model's vocabulary. Its index takes about a second to build: a thread builds it
    from the start, so that the first constrained request does not stall the running batch for it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab: int, eos_token_ids: list[int]) -> None:
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self._index: LLTokenizer | None = None
        self._failure: Exception | None = None
        self._building = threading.Thread(target=self._build, args=(tokenizer, vocab, eos_token_ids),
                                          name="grammar-index", daemon=True)
        self._building.start()

    def _build(self, tokenizer: PreTrainedTokenizerBase, vocab: int, eos: list[int]) -> None:
        try:
            self._index = from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        except Exception as exc:  # a tokenizer llguidance cannot read: constrained requests fail, others run
            self._failure = exc

    def index(self) -> LLTokenizer:
        self._building.join()
        if self._index is None:
            raise GrammarError(f"this model's tokenizer cannot take grammars: {self._failure}")
        return self._index

    def matcher(self, grammar: str, replay: list[int]) -> LLMatcher:
        """A matcher for `grammar` that has seen `replay` (the tokens a migrated request delivered)."""
        matcher = LLMatcher(self.index(), grammar, log_level=0)
        if replay and not matcher.consume_tokens(replay):
            raise GrammarError(f"the delivered tokens do not keep to the grammar: {matcher.get_error()}")
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {matcher.get_error()}")
        return matcher

    def allowed(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """[rows, vocab] booleans: the tokens each matcher allows next."""
        words = torch.empty((len(matchers), self.words), dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            view = words[row]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        bits = (words.unsqueeze(-1) >> _BITS) & 1
        return bits.view(len(matchers), -1)[:, :self.vocab].bool()
