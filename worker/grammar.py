"""Grammars enforced token by token (structured outputs and tool calls): one llguidance matcher per
constrained row, which says before each step which tokens may come next and is told the one chosen.
Only that row's logits are masked, so constrained and free rows share a batch unchanged. Shared by the engines
that sample themselves (the own engine and llama.cpp's); the gateway's check of a grammar is common/grammar.py."""

from __future__ import annotations

import json
import threading

import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from transformers import PreTrainedTokenizerBase

from common.grammar import ENFORCED_ROW_ITEMS, GrammarError

# A mask byte's eight tokens as logit biases, little end first: 0 for a token allowed, -inf for one not.
# A lookup per byte and one addition cost a quarter of unpacking the bits and filling the logits with them.
_BYTE_BIASES = torch.tensor([[0.0 if (byte >> bit) & 1 else float("-inf") for bit in range(8)]
                             for byte in range(256)])


def vocabulary_json(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer as the JSON llguidance reads its tokens' bytes from. A byte-level BPE whose decoder is a
    sequence around ByteLevel (how transformers 5.17 writes a GGUF file's tokenizer: byte fallback, fuse,
    replace, then ByteLevel) gets the ByteLevel step alone: read as written, its tokens' bytes were their
    characters ('Ġ', not a space), and every grammar that needs a space failed at it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("only a fast (Rust) tokenizer can take grammars")
    spec = json.loads(backend.to_str())
    spec["padding"] = spec["truncation"] = None
    decoder, pre = spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}
    level = [step for step in decoder.get("decoders") or [] if step.get("type") == "ByteLevel"]
    if decoder.get("type") == "Sequence" and level and pre.get("type") == "ByteLevel":
        spec["decoder"] = level[0]
    return json.dumps(spec)


class Grammars:
    """Matchers over one model's vocabulary. Its index takes about a second to build: a thread builds it
    from the start, so that the first constrained request does not stall the running batch for it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab: int, eos_token_ids: list[int]) -> None:
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self._index: LLTokenizer | None = None
        self._biases = torch.empty((0, 8))  # what the last step's biases were written into
        self._failure: Exception | None = None
        self._building = threading.Thread(target=self._build, args=(tokenizer, vocab, eos_token_ids),
                                          name="grammar-index", daemon=True)
        self._building.start()

    def _build(self, tokenizer: PreTrainedTokenizerBase, vocab: int, eos: list[int]) -> None:
        try:
            self._index = LLTokenizer(vocabulary_json(tokenizer), n_vocab=vocab, eos_token=eos)
        except Exception as exc:  # a tokenizer llguidance cannot read: constrained requests fail, others run
            self._failure = exc

    def index(self) -> LLTokenizer:
        self._building.join()
        if self._index is None:
            raise GrammarError(f"this model's tokenizer cannot take grammars: {self._failure}")
        return self._index

    def matcher(self, grammar: str, replay: list[int]) -> LLMatcher:
        """A matcher for `grammar` that has seen `replay` (the tokens a migrated request delivered)."""
        matcher = LLMatcher(self.index(), grammar, log_level=0,
                            limits=LLParserLimits(max_items_in_row=ENFORCED_ROW_ITEMS))
        if replay and not matcher.consume_tokens(replay):
            raise GrammarError(f"the delivered tokens do not keep to the grammar: {matcher.get_error()}")
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {matcher.get_error()}")
        return matcher

    def row_biases(self, matchers: list[LLMatcher | None], device: torch.device | None = None
                   ) -> list[torch.Tensor | None]:
        """Each constrained row's logit biases (`biases`), None for a free row. A matcher that has failed allows
        nothing; its row then fails when its token is checked."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        found: list[torch.Tensor | None] = [None] * len(matchers)
        if rows:
            masks = self.biases([matchers[row] for row in rows])
            masks = masks.to(device) if device is not None else masks
            for i, row in enumerate(rows):
                found[row] = masks[i]
        return found

    def biases(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """[rows, vocab] logit biases: 0 for the tokens each matcher allows next, -inf for the others. They
        hold until the next call, which writes over them."""
        words = torch.empty((len(matchers), self.words), dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            view = words[row]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        mask_bytes = words.view(torch.uint8).view(-1).long()
        if self._biases.shape[0] < mask_bytes.numel():
            self._biases = torch.empty((mask_bytes.numel(), 8))
        out = self._biases[:mask_bytes.numel()]
        # Into a buffer kept across steps: a fresh result tensor costs five times the lookup itself.
        torch.index_select(_BYTE_BIASES, 0, mask_bytes, out=out)
        return out.view(len(matchers), -1)[:, :self.vocab]
