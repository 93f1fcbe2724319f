#!/usr/bin/env python3
# Writes the small tokenizer.json files that tests/unit/test_hf_tokenizer.cpp loads. Only the
# 256-symbol byte alphabet is mechanical; merges and added tokens are chosen by hand, and the
# tests' expected ids are derived by hand from this listing. Run: python3 make_test_tokenizers.py
import json
import os


def bytes_to_unicode():
    """GPT-2's byte -> character table: printable bytes stand for themselves, the rest for 256+."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_vocab():
    # Id of each byte's symbol = the byte value, so expected ids can be read off the text's bytes.
    table = bytes_to_unicode()
    return {table[b]: b for b in range(256)}


def with_merges(vocab, merges):
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return vocab


def added(id_, content, special=True, normalized=False, **flags):
    token = {"id": id_, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": normalized, "special": special}
    token.update(flags)
    return token


BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# byte_bpe.json: ByteLevel with the GPT-2 regex, merges as [a, b] pairs.
# ids: bytes 0..255, then 256 bc, 257 ab, 258 Ġt, 259 he, 260 Ġthe, 261 Ã©, 262 ca, 263 fÃ©,
# 264 cafÃ©, 265 12, 266 ĠĠ; added 267 BOS, 268 EOS, 269 <|x|>, 270 <|x|>y, 271 zz.
BYTE_BPE_MERGES = [("b", "c"), ("a", "b"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©"), ("c", "a"),
                   ("f", "Ã©"), ("ca", "fÃ©"), ("1", "2"), ("Ġ", "Ġ")]
byte_bpe = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [added(267, BOS), added(268, EOS), added(269, "<|x|>"),
                     added(270, "<|x|>y", special=False),
                     added(271, "zz", special=False, normalized=True)],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                       "special_tokens": {BOS: {"id": BOS, "ids": [267], "tokens": [BOS]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "vocab": with_merges(byte_vocab(), BYTE_BPE_MERGES),
              "merges": [[a, b] for a, b in BYTE_BPE_MERGES]},
}

# deepseek_style.json: DeepSeek-V3's pre-tokenizer (three Split regexes, ByteLevel without its
# regex), merges as "a b" strings after a #version line.
# ids: bytes 0..255, then 256 Ġt, 257 he, 258 Ġthe, 259 12, 260 123, 261 Ã©, 262 o,, 263 d!,
# 264 Ńa, 265 eÌ, 266 Ġâ, 267 ĊĊ, 268 ĠĠ; added 269 BOS, 270 EOS.
DEEPSEEK_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("12", "3"), ("Ã", "©"), ("o", ","),
                   ("d", "!"), ("Ń", "a"), ("e", "Ì"), ("Ġ", "â"), ("Ċ", "Ċ"), ("Ġ", "Ġ")]
DEEPSEEK_V3_SPLITS = [
    "\\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
deepseek_style = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [added(269, BOS), added(270, EOS)],
    "normalizer": {"type": "Sequence", "normalizers": []},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in DEEPSEEK_V3_SPLITS] + [
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "vocab": with_merges(byte_vocab(), DEEPSEEK_MERGES),
              "merges": ["#version: 0.2"] + [f"{a} {b}" for a, b in DEEPSEEK_MERGES]},
}

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    for name, tok in [("byte_bpe.json", byte_bpe), ("deepseek_style.json", deepseek_style)]:
        with open(os.path.join(here, name), "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False, indent=1)
            f.write("\n")
