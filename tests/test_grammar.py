"""Grammars in the engine, on the real default model in-process: a constrained answer keeps to its schema
and ends where the grammar does, constrained and free rows share a batch without changing each other's
tokens, a migrated constrained request continues exactly, and a grammar that cannot be enforced fails only
its own request."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from tokenizers import decoders

from common import grammar
from common.protocol import SamplingParams
from tests.conftest import run_engine
from worker.core import GrammarError
from worker.grammar import Grammars
from worker.own.engine import Engine
from worker.own.model import LoadedModel

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person who lives in Paris as JSON."}]
FREE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def constrained(schema: dict, **fields: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 0, **fields},
                          grammar=grammar.checked(grammar.json_schema(schema)))


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
        resume: dict[str, list[int]] | None = None) -> dict[str, tuple[list[int], str, str | None]]:
    """Each request's tokens, text and finish reason (or error)."""
    outputs = run_engine(engine, {0: [(key, ids, params, (resume or {}).get(key))
                                      for key, (ids, params) in requests.items()]})
    return {key: ([o.token_id for o in outs], "".join(o.text for o in outs), outs[-1].error or outs[-1].finish_reason)
            for key, outs in outputs.items()}


def test_a_constrained_answer_keeps_to_its_schema_and_ends_with_it(loaded: LoadedModel) -> None:
    ids = loaded.chat_ids(ASK)
    # ignore_eos too: the grammar's end, not end-of-sequence, ends the answer.
    answer = run(Engine(loaded, 4), {"p": (ids, constrained(PERSON, ignore_eos=True))})["p"]
    tokens, text, reason = answer
    jsonschema.validate(json.loads(text), PERSON)
    assert reason == "stop" and len(tokens) < 120


def test_constrained_and_free_rows_share_a_batch_unchanged(loaded: LoadedModel) -> None:
    ids = loaded.chat_ids(ASK)
    free_ids = loaded.tokenizer("Once upon a time, in a small village")["input_ids"]
    alone_c = run(Engine(loaded, 4), {"c": (ids, constrained(PERSON))})["c"]
    alone_f = run(Engine(loaded, 4), {"f": (free_ids, FREE)})["f"]
    together = run(Engine(loaded, 4), {"f": (free_ids, FREE), "c": (ids, constrained(PERSON)),
                                       "g": (list(ids), FREE)})
    assert together["c"] == alone_c
    assert together["f"] == alone_f
    assert not together["g"][1].startswith('{"name": '), "the free row with the same prompt is not constrained"


def test_a_migrated_constrained_request_continues_exactly(loaded: LoadedModel) -> None:
    ids = loaded.chat_ids(ASK)
    whole = run(Engine(loaded, 4), {"p": (ids, constrained(PERSON))})["p"]
    delivered = whole[0][:9]
    rest = run(Engine(loaded, 4), {"p": (ids, constrained(PERSON))}, resume={"p": delivered})["p"]
    assert delivered + rest[0] == whole[0]
    assert rest[2] == whole[2] == "stop"


def test_a_choice_is_answered_verbatim_and_ends_at_once(loaded: LoadedModel) -> None:
    ids = loaded.chat_ids([{"role": "user", "content": "Is Paris in France? Answer yes or no."}])
    options = ["yes, it is", "no"]
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=3, grammar=grammar.checked(grammar.choice(options)))
    tokens, text, reason = run(Engine(loaded, 4), {"q": (ids, params)})["q"]
    assert text in options and reason == "stop"
    assert tokens[-1] not in loaded.eos_token_ids, "the grammar's end ends it: no step for end-of-sequence"


def test_a_grammar_the_engine_cannot_build_fails_alone(loaded: LoadedModel) -> None:
    engine = Engine(loaded, 4)
    ids = loaded.tokenizer("Paris is")["input_ids"]
    with pytest.raises(GrammarError):
        engine.add("bad", ids, SamplingParams(grammar="not a grammar at all"))
    with pytest.raises(GrammarError):  # delivered tokens that break the grammar (a replay gone wrong)
        engine.add("odd", ids, constrained(PERSON), resume=loaded.tokenizer.encode("Hello", add_special_tokens=False))
    assert run(engine, {"ok": (ids, FREE)})["ok"][2] == "length"


def test_a_byte_level_vocabulary_reads_as_bytes_whatever_decoder_transformers_wrote(loaded: LoadedModel) -> None:
    """transformers 5.17 writes the default model's tokenizer (from its GGUF file) with a decoder sequence around
    ByteLevel; read as written, the index took the space tokens for 'Ġ', and after `{"city":` a schema's `: `
    allowed only a token that the matcher then refused. Both ways of writing it give the same index."""
    older = copy.deepcopy(loaded.tokenizer)
    older.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    schema = grammar.json_schema({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    opened = loaded.tokenizer('{"city":', add_special_tokens=False)["input_ids"]
    space_quote = loaded.tokenizer(' "', add_special_tokens=False)["input_ids"]
    assert len(space_quote) == 1
    allowed = []
    for tokenizer in (loaded.tokenizer, older):
        grammars = Grammars(tokenizer, loaded.vocab, loaded.eos_token_ids)
        biases = grammars.biases([grammars.matcher(schema, opened)])[0]
        allowed.append(set((biases == 0).nonzero().flatten().tolist()))
    assert space_quote[0] in allowed[0] and allowed[0] == allowed[1]
