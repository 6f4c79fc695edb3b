"""IncrementalDetokenizer: the streamed pieces add up to tokenizer.decode, whatever the split into steps."""

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"


def random_split(ids, rng):
    """Splits ids into consecutive chunks of random sizes (including empty chunks)."""
    chunks, i = [], 0
    while i < len(ids):
        size = rng.choice([0, 1, 1, 1, 2, 3, 5])
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def stream(tokenizer, prompt_ids, chunks, skip):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.update(c, finished=(k == len(chunks) - 1)) for k, c in enumerate(chunks)]
    assert "".join(pieces) == detok.output_text
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_any_split_matches_decode(tokenizer, skip):
    rng = random.Random(1234 + skip)
    vocab = len(tokenizer)
    for _ in range(300):
        prompt = tokenizer.encode(rng.choice(["Hello", "The dog", "日本", ""]), add_special_tokens=False)
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        pieces = stream(tokenizer, prompt, random_split(ids, rng) + [[]], skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_decoding_a_whole_output_at_once_equals_streaming_it(tokenizer, skip):
    """decode_whole (FINAL_ONLY outputs) gives the streamed text, for in-vocabulary ids, special
    tokens, multi-byte characters, prompts ending mid-character, and ids the tokenizer does not know."""
    rng = random.Random(99 + skip)
    vocab = len(tokenizer)
    texts = ["Hello", "The dog", "日本", "", "café 🙂", "<|im_start|>assistant\n"]
    for _ in range(400):
        prompt = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        if rng.random() < 0.2:
            prompt = prompt + tokenizer.encode("日", add_special_tokens=False)[:1]  # ends mid-character
        hi = vocab if rng.random() < 0.7 else 4 * vocab  # ids past the tokenizer's vocabulary decode to ""
        ids = [rng.randrange(hi) for _ in range(rng.randrange(0, 40))]
        streamed = "".join(stream(tokenizer, prompt, random_split(ids, rng) + [[]], skip))
        whole = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        assert whole.decode_whole(ids) == streamed == whole.output_text


@pytest.mark.parametrize("skip", [True, False])
def test_multibyte_text_never_streams_replacement_char(tokenizer, skip):
    text = "café 日本語 🙂<|im_end|> naïve Zürich ✨ русский<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in ids
    # Byte-level BPE splits these characters over several tokens, so some tokens alone are partial.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in expected) == (not skip)
    rng = random.Random(7)
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for _ in range(200):
        pieces = stream(tokenizer, prompt, random_split(ids, rng), skip)
        assert "".join(pieces) == expected
        assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_one_token_at_a_time_emits_whole_characters(tokenizer):
    ids = tokenizer.encode("日本", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.update([i]) for i in ids]
    assert [p for p in pieces if p] == ["日", "本"]
    assert pieces[0] == ""  # the first byte alone is not a character yet


def test_pending_bytes_flushed_when_finished(tokenizer):
    ids = tokenizer.encode("日", add_special_tokens=False)[:2]  # an incomplete character
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.update(ids) == ""
    assert detok.update([], finished=True) == tokenizer.decode(ids) == detok.output_text
    assert REPLACEMENT_CHAR in detok.output_text


def test_prompt_ending_mid_character_is_not_used_as_context(tokenizer):
    ids = tokenizer.encode("日本", add_special_tokens=False)
    prompt, out = ids[:1], ids[1:]
    pieces = stream(tokenizer, prompt, [[i] for i in out], skip=True)
    assert "".join(pieces) == tokenizer.decode(out)


def test_prompt_context_keeps_leading_space_for_metaspace_tokenizer():
    """A SentencePiece-style decoder strips the first token's leading space; with the prompt as
    context the first output token keeps it, as decode(prompt + output) would show."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["Hello world, hello there world."] * 10, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)

    prompt = tok.encode("Hello", add_special_tokens=False)
    full = tok.encode("Hello world there", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    out = full[len(prompt) :]
    assert tok.decode(out) == "world there"  # decoded alone: the leading space is stripped
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.update([i]) for i in out) + detok.update([], finished=True)
    assert text == " world there" == tok.decode(full)[len(tok.decode(prompt)) :]
    assert IncrementalDetokenizer(tok, prompt).decode_whole(out) == text  # the FINAL_ONLY path too
