#!/usr/bin/env python3
"""Compares dstrain's tokenizer.json BPE (src/data/hf_tokenizer.cpp) with the Hugging Face
`tokenizers` library, the reference, id for id.

It trains small byte-level BPE tokenizers with the library on /usr/share/games/fortunes and
/usr/share/common-licenses: one DeepSeek-V3 style (its three Split regexes, Isolated, then
ByteLevel without regex, DeepSeek's special tokens) and a few others that exercise the other
supported components (GPT-2 ByteLevel with prefix space, Digits, Split behaviours, added tokens
with lstrip/rstrip/single_word). For each it saves tokenizer.json, runs build/app/dstrain-prep
on the corpus and on edge cases (Unicode, digits, whitespace runs, special tokens inside text),
reads the llm.c shards back and checks that every document's ids equal the library's
encode(text, add_special_tokens=False).ids followed by the eos id. The library runs with its
encode_special_tokens flag set, as dstrain encodes: special tokens inside a document's text are
plain text (a document cannot forge an eos), non-special added tokens still match. Exits 1 on
any mismatch.

    /usr/bin/python3 validation/compare_tokenizers.py [--build build] [--vocab 4000]
    /usr/bin/python3 validation/compare_tokenizers.py --print-unicode-delta

The library comes from the venv that validation/peer_venv.sh makes (on first use; ctest runs
this script in it as `interop.tokenizers`). --print-unicode-delta prints the code points that
the library's regex engine (Oniguruma, newer Unicode) puts in \\p{L}, \\p{M}, \\p{N}, \\p{P},
\\p{S} and \\d beyond Unicode 14 (Debian's PCRE2 10.42 and Python 3.11), as the
C++ table hf_tokenizer.cpp adds to those classes.
"""

import argparse
import glob
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_tokenizers():
    """Re-runs this script under the peer venv (validation/peer_venv.sh: made once per machine,
    outside the repository, with `tokenizers` among its packages) unless this Python has it."""
    try:
        import tokenizers  # noqa: F401
        return
    except ImportError:
        pass
    p = subprocess.run([os.path.join(ROOT, "validation", "peer_venv.sh")], stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit("compare_tokenizers: no Python with `tokenizers` (validation/peer_venv.sh failed, see above)")
    python = p.stdout.strip().splitlines()[-1]
    if os.path.abspath(sys.executable) == os.path.abspath(python):
        sys.exit(f"compare_tokenizers: {python} cannot import `tokenizers`")
    os.execv(python, [python] + sys.argv)


BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
DEEPSEEK_V3_SPLITS = [
    "\\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
SEPARATOR = "\x1e<dstrain-compare-document>\x1e"  # a line that ends a document for dstrain-prep


# ---- corpus and documents --------------------------------------------------------------------

def corpus_documents():
    """Fortunes (one per document, split on "%" lines) and license paragraphs."""
    docs = []
    for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if path.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the library takes only valid UTF-8
        docs += [d for d in text.split("\n%\n") if d.strip()]
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="strict") as f:
            docs += [p for p in f.read().split("\n\n") if p.strip()]
    return docs


def edge_cases(seed=7):
    cases = [
        # Unicode
        "café naïve résumé Ångström", "中文测试，日本語のテキスト、カタカナとひらがな。", "한국어 텍스트",
        "Ελληνικά κείμενα", "русский текст, ёжик", "مرحبا بالعالم ٣٤٥", "नमस्ते दुनिया १२३",
        "emoji 😀👍🏽 🇺🇸 👨‍👩‍👧 ❤️", "new in Unicode 15/16: 🫨🫷🪿 \U00031350\U00031351 \U0001CC00 \u1C89",
        "combining: e\u0301 a\u0308 n\u0303, Zalgo: h\u0335\u0321e\u0336l\u0337l\u0338o",
        "math 𝔸𝔹ℂ ∑∫√∞ ≠ ≤", "soft\u00adhyphen", "zero\u200bwidth\u200djoiner\ufeffbom",
        "spaces: nbsp\u00a0ideographic\u3000em\u2003thin\u2009mongolian\u180evs",
        "separators: line\u2028para\u2029next\u0085end",
        "mongolian vowel separator: a \u180e\u180e b\t\u180e\t\u180e\n\u180e end \u180e",
        "fullwidth ＡＢＣ１２３！", "x²+y³=z¹⁰ ½ ¾ Ⅻ",
        "private \ue000\uf8ff use", "controls \x01\x02\x08\x7f and overstrike a\x08a_\x08b",
        # digits
        "1234567890", "3.14159265358979", "1,000,000.00", "٣٤٥٦٧", "phone +1-555-0100 ext. 42", "v2.0.11-rc3",
        "0x1F600 0b1010 1e-9 42nd 2024年10月", "12345678901234567890123",
        # whitespace
        "a  b   c    d", "\t\ttabs\tand  \t spaces", "trailing   ", "   leading", "\r\n\r\nwindows\r\nlines\r\n",
        "mixed \t \n \r\n  end", "\n\n\n\n", " ", "\t", "a\n \n b", "word\n\n\n  \n\t\nword",
        # added and special tokens inside text
        f"hello{EOS}world", f"{BOS}start", f"a{PAD}b{EOS}c{BOS}", f"partial <｜end▁of▁sent and {EOS[:-1]}",
        f"{EOS}{EOS}{BOS}", f"text {EOS} text", "<think>reasoning here</think>answer", "x<think>y",
        "<tool> call </tool>", "a <tool> b", "foo food seafood  foo  foo.bar _foo foo_",
        # punctuation and code
        "don't you're I'll we've she'd it's", ".NET C# C++ node.js ASP.NET", "!!!???... ---- ====",
        "(a)[b]{c}<d>", "e-mail: foo@example.com, URL http://x.y/z?q=1&r=2#frag", "#hashtag @mention $100 50% ^_^",
        "def f(x):\n    return x ** 2  # comment\n", "int main() { return 0; }\n", "'''quoted''' \"double\" `tick`",
        "a" * 3000, " " * 2000, "ab " * 1500, "\n" * 500, "😀" * 300,
    ]
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0x80, 0x2FF), (0x300, 0x36F), (0x370, 0x52F), (0x600, 0x6FF),
              (0x900, 0x97F), (0x2000, 0x206F), (0x2100, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF),
              (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]
    for _ in range(400):
        chars = []
        for _ in range(rng.randrange(1, 60)):
            lo, hi = rng.choice(ranges)
            c = rng.randint(lo, hi)
            if 0xD800 <= c <= 0xDFFF:
                continue
            chars.append(chr(c))
            r = rng.random()
            if r < 0.15:
                chars.append(" ")
            elif r < 0.2:
                chars.append(rng.choice(["\n", "  ", "\t", EOS, "1", "<think>", "foo"]))
        cases.append("".join(chars))
    # A line that is exactly the separator would end the document early.
    return [c for c in cases if SEPARATOR not in c]


def documents_file(docs, path):
    """Writes docs for dstrain-prep --split-on-line SEPARATOR; returns the documents exactly as
    dstrain-prep will cut them (app/dstrain_prep.cpp: split_documents), so both sides encode the
    same strings."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        for d in docs:
            f.write(d if d.endswith("\n") else d + "\n")
            f.write(SEPARATOR + "\n")
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    out, doc_begin, line_begin = [], 0, 0
    while line_begin < len(text):
        nl = text.find("\n", line_begin)
        line_end = len(text) if nl < 0 else nl
        next_line = len(text) if nl < 0 else nl + 1
        if text[line_begin:line_end] == SEPARATOR:
            if line_begin > doc_begin:
                out.append(text[doc_begin:line_begin])
            doc_begin = next_line
        line_begin = next_line
    if len(text) > doc_begin:
        out.append(text[doc_begin:])
    return out


# ---- tokenizers under test ----------------------------------------------------------------------

def train(name, corpus, vocab_size):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    added = []
    if name == "deepseek_v3":
        tok.normalizer = normalizers.Sequence([])
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in DEEPSEEK_V3_SPLITS]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
        added = [AddedToken("<think>", special=False, normalized=False),
                 AddedToken("</think>", special=False, normalized=False)]
    elif name == "gpt2_prefix_space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        added = [AddedToken("<tool>", special=False, lstrip=True, rstrip=True, normalized=False),
                 AddedToken("</tool>", special=True, lstrip=False, rstrip=True, normalized=False),
                 AddedToken("foo", special=False, single_word=True, normalized=True)]
    elif name == "digits_and_behaviours":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(Regex("\\s+"), behavior="merged_with_next"),
            pre_tokenizers.Split("-", behavior="contiguous"),
            pre_tokenizers.Split(Regex("[\\p{P}]"), behavior="merged_with_previous"),
            pre_tokenizers.Split(Regex("x+"), behavior="merged_with_next", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        added = [AddedToken("foo", special=False, normalized=False), AddedToken("<think>", special=True)]
    else:
        raise ValueError(name)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if added:
        tok.add_tokens(added)
    tok.encode_special_tokens = True  # dstrain's Tokenizer contract; see the module docstring
    return tok


# ---- dstrain side ---------------------------------------------------------------------------------

def read_shards(prefix):
    tokens = []
    for path in sorted(glob.glob(prefix + "_train_*.bin")):
        with open(path, "rb") as f:
            header = struct.unpack("<256i", f.read(1024))
            magic, version, n = header[0], header[1], header[2]
            width = {20240520: 2, 20240801: 4}[magic]
            body = f.read()
        assert len(body) == n * width, f"{path}: {len(body)} bytes for {n} tokens of version {version}"
        tokens += struct.unpack(f"<{n}{'H' if width == 2 else 'I'}", body)
    return tokens


def run_prep(build, tokenizer_json, docs_path, work, threads):
    prep = os.path.join(build, "app", "dstrain-prep")
    prefix = os.path.join(work, "shard")
    for old in glob.glob(prefix + "_*.bin"):
        os.remove(old)
    start = time.perf_counter()
    out = subprocess.run([prep, "--input", docs_path, "--output-prefix", prefix, "--tokenizer", tokenizer_json,
                          "--split-on-line", SEPARATOR, "--val-docs", "0", "--threads", str(threads)],
                         capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"dstrain-prep failed:\n{out.stdout}\n{out.stderr}")
    rate = [line for line in out.stdout.splitlines() if "MB/s" in line]
    return read_shards(prefix), seconds, (rate[0] if rate else "")


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(name, tok, docs, dstrain_ids, eos):
    """Splits dstrain's token stream on eos (no document's text can produce it: both sides
    encode special tokens as text) and compares document by document."""
    got_docs, begin = [], 0
    for i, t in enumerate(dstrain_ids):
        if t == eos:
            got_docs.append(dstrain_ids[begin:i])
            begin = i + 1
    mismatches = 0
    if len(got_docs) != len(docs) or begin != len(dstrain_ids):
        print(f"  {name}: dstrain wrote {len(got_docs)} documents (+{len(dstrain_ids) - begin} tokens after the "
              f"last eos), the library sees {len(docs)}")
        mismatches += 1
    for i, (doc, got) in enumerate(zip(docs, got_docs)):
        want = tok.encode(doc, add_special_tokens=False).ids
        if got != want:
            mismatches += 1
            if mismatches <= 5:
                k = first_difference(got, want)
                print(f"  MISMATCH {name} document {i} ({len(doc)} chars): {doc[:100]!r}")
                print(f"    first difference at token {k}: dstrain {got[max(0, k - 3):k + 4]} "
                      f"library {want[max(0, k - 3):k + 4]} "
                      f"{[tok.id_to_token(t) for t in want[max(0, k - 3):k + 4]]}")
    return mismatches


def print_unicode_delta():
    import unicodedata

    from tokenizers import Regex, pre_tokenizers
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    text = "".join(chars)
    print(f"// Generated by validation/compare_tokenizers.py --print-unicode-delta: tokenizers "
          f"{__import__('tokenizers').__version__} vs Unicode {unicodedata.unidata_version}.")
    for name, pattern, test in [
            ("L", r"\p{L}", lambda c: unicodedata.category(c).startswith("L")),
            ("M", r"\p{M}", lambda c: unicodedata.category(c).startswith("M")),
            ("N", r"\p{N}", lambda c: unicodedata.category(c).startswith("N")),
            ("P", r"\p{P}", lambda c: unicodedata.category(c).startswith("P")),
            ("S", r"\p{S}", lambda c: unicodedata.category(c).startswith("S")),
            ("Nd", r"\d", lambda c: unicodedata.category(c) == "Nd")]:
        kept = set()
        for _, (a, b) in pre_tokenizers.Split(Regex(pattern), "removed").pre_tokenize_str(text):
            kept.update(range(a, b))
        extra = [ord(chars[i]) for i in range(len(chars)) if i not in kept and not test(chars[i])]
        ranges = []
        for c in extra:
            if ranges and ranges[-1][1] == c - 1:
                ranges[-1][1] = c
            else:
                ranges.append([c, c])
        parts = [f"\\\\x{{{a:X}}}" if a == b else f"\\\\x{{{a:X}}}-\\\\x{{{b:X}}}" for a, b in ranges]
        lines, line = [], ""
        for part in parts:
            if len(line) + len(part) > 100:
                lines.append(line)
                line = ""
            line += part
        lines.append(line)
        print(f'    {{"{name}",')
        print("\n".join(f'     "{text}"' for text in lines[:-1]))
        print(f'     "{lines[-1]}"}},')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"), help="build directory with app/dstrain-prep")
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", help="keep the tokenizer.json files and shards in this directory")
    parser.add_argument("--print-unicode-delta", action="store_true")
    args = parser.parse_args()
    ensure_tokenizers()
    if args.print_unicode_delta:
        print_unicode_delta()
        return 0
    import tokenizers
    print(f"compare_tokenizers: tokenizers {tokenizers.__version__}, dstrain-prep from {args.build}")

    corpus = corpus_documents()
    # The edge cases go into training too, repeated, so that the vocabulary has merges over
    # their characters: otherwise a difference in how text is cut could hide behind byte ids.
    training = corpus + edge_cases() * 10
    work = args.keep or tempfile.mkdtemp(prefix="dstrain_compare_tok_")
    os.makedirs(work, exist_ok=True)
    docs = documents_file(corpus + edge_cases(), os.path.join(work, "docs.txt"))
    corpus_bytes = sum(len(d.encode("utf-8")) for d in docs)
    total_docs = total_mismatches = 0
    try:
        for name in ["deepseek_v3", "gpt2_prefix_space", "digits_and_behaviours"]:
            t0 = time.perf_counter()
            tok = train(name, training, args.vocab)
            path = os.path.join(work, f"{name}.json")
            tok.save(path)
            eos = tok.token_to_id(EOS)
            ids, seconds, rate = run_prep(args.build, path, os.path.join(work, "docs.txt"), work, args.threads)
            t1 = time.perf_counter()
            for d in docs:
                tok.encode(d, add_special_tokens=False)
            lib_seconds = time.perf_counter() - t1
            bad = compare(name, tok, docs, ids, eos)
            total_docs += len(docs)
            total_mismatches += bad
            print(f"{name}: vocab {tok.get_vocab_size()}, {len(docs)} documents ({corpus_bytes / 1e6:.2f} MB), "
                  f"{len(ids)} tokens, {bad} mismatches; dstrain-prep {seconds:.2f} s [{rate.strip()}], "
                  f"library encode (1 thread) {corpus_bytes / 1e6 / lib_seconds:.2f} MB/s "
                  f"(trained in {t1 - t0 - seconds:.1f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"compare_tokenizers: {total_docs} documents compared, {total_mismatches} mismatches")
    return 1 if total_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
