#!/usr/bin/env python3
"""Build the default training data from the Debian `fortunes` package.

    python3 dev/data/prepare_fortunes.py             # write dev/data/fortunes/*.bin
    python3 dev/data/prepare_fortunes.py --check     # rebuild in a temp dir, compare bytes
    python3 dev/data/prepare_fortunes.py --selftest  # tokenizer checks only

Python 3 standard library only. The GPT-2 tokenizer (regex pre-split and
byte-level BPE) is implemented here from its published definition; the merge
ranks come from dev/data/gpt2.tiktoken. See dev/data/README.md.
"""
import argparse, base64, os, struct, sys, tempfile, time, unicodedata
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
SRC_DIR = "/usr/share/games/fortunes"
OUT_DIR = os.path.join(HERE, "fortunes")
RANKS_PATH = os.path.join(HERE, "gpt2.tiktoken")
OUT_NAMES = ("fortunes_train.bin", "fortunes_val.bin", "gpt2_tokenizer.bin")
EOT = 50256          # <|endoftext|>, not in the ranks file
VOCAB = 50257
VAL_EVERY = 20       # fortune i goes to val iff i % 20 == 19

# The text files of `fortunes` + `fortunes-min` (Debian 1:1.99.1-7.3), fixed so
# that another fortune package dropping files into SRC_DIR can't change the data.
SRC_FILES = sorted("""
art ascii-art computers cookie debian definitions disclaimer drugs education
ethnic food fortunes goedel humorists kids knghtbrd law linux linuxcookie
literature love magic medicine men-women miscellaneous news paradoxum people
perl pets platitudes politics pratchett riddles science songs-poems sports
startrek tao translate-me wisdom work zippy""".split())

# ---------------------------------------------------------------- tokenizer
# Unicode White_Space (what \s means in GPT-2's regex). Not str.isspace():
# that also counts U+001C..U+001F, which the regex does not.
WHITESPACE = set("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000")
WHITESPACE |= {chr(c) for c in range(0x2000, 0x200B)}
_cls_cache = {}


def char_class(ch):
    """'S' whitespace, 'L' letter (\\p{L}), 'N' number (\\p{N}), 'O' other."""
    c = _cls_cache.get(ch)
    if c is None:
        if ch in WHITESPACE:
            c = "S"
        else:
            c = unicodedata.category(ch)[0]
            c = c if c in "LN" else "O"
        _cls_cache[ch] = c
    return c


def presplit(s):
    """Hand-written equivalent of GPT-2's pre-tokenizer regex
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
    Alternatives are tried in order at each position, as the regex does."""
    n, cls, out, i = len(s), [char_class(ch) for ch in s], [], 0
    while i < n:
        j = 0
        if s[i] == "'":  # contractions, case-sensitive like the original
            if s[i + 1:i + 3] in ("re", "ve", "ll"):
                j = i + 3
            elif s[i + 1:i + 2] in ("s", "t", "m", "d"):
                j = i + 2
        if not j:
            # ` ?X+`: a single ASCII space may lead a run of one class X.
            k = i + 1 if s[i] == " " and i + 1 < n and cls[i + 1] != "S" else i
            c = cls[k]
            j = k + 1
            while j < n and cls[j] == c:
                j += 1
            # \s+(?!\S): a whitespace run stops one short of a non-space so
            # that its last char can lead the next word; a lone one stays.
            if c == "S" and j < n and j - 1 > i:
                j -= 1
        out.append(s[i:j])
        i = j
    return out


def load_ranks(path):
    """gpt2.tiktoken: one `base64(token bytes) rank` per line; rank = token id."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bpe(piece, ranks):
    """Byte-level BPE: merge the adjacent pair whose joined bytes have the
    lowest rank (leftmost on ties) until no joined pair is a token."""
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best, at = None, -1
        for k in range(len(parts) - 1):
            r = ranks.get(parts[k] + parts[k + 1])
            if r is not None and (best is None or r < best):
                best, at = r, k
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return [ranks[p] for p in parts]


class Encoder:
    def __init__(self, ranks):
        self.ranks, self.cache = ranks, {}  # cache: piece -> ids

    def encode(self, text):
        ids = []
        for piece in presplit(text):
            t = self.cache.get(piece)
            if t is None:
                t = self.cache[piece] = bpe(piece.encode("utf-8"), self.ranks)
            ids.extend(t)
        return ids


def selftest(enc):
    # Ids of well-known GPT-2 tokens / encodings.
    cases = {"Hello world": [15496, 995], " the": [262], "\n\n": [628],
             "\n": [198], "hello world": [31373, 995],
             "Hello, world!": [15496, 11, 995, 0], "It's": [1026, 338],
             "x\n\ny": [87, 198, 198, 88]}
    splits = {"a  b": ["a", " ", " b"], "I'll go": ["I", "'ll", " go"],
              "x\n\ny": ["x", "\n", "\n", "y"], "We'RE 12ab": ["We", "'", "RE", " 12", "ab"],
              "  \n": ["  \n"], "?!'s": ["?!'", "s"], "caf\u00e9 \u00bd": ["caf\u00e9", " \u00bd"]}
    bad = [f"encode({s!r}) = {enc.encode(s)}, want {w}"
           for s, w in cases.items() if enc.encode(s) != w]
    bad += [f"presplit({s!r}) = {presplit(s)}, want {w}"
            for s, w in splits.items() if presplit(s) != w]
    if bad:
        sys.exit("selftest FAILED:\n  " + "\n  ".join(bad))
    print(f"selftest ok ({len(cases)} encodings, {len(splits)} pre-splits)")

# ---------------------------------------------------------------- data


def read_fortunes():
    """All fortunes of all SRC_FILES, in order. A fortune ends at a line that is
    exactly `%`; trailing whitespace is stripped and empty fortunes dropped.
    Text is decoded as UTF-8 with errors replaced by U+FFFD (all files of
    1:1.99.1-7.3 decode cleanly, so nothing is replaced; we say so if it is)."""
    missing = [f for f in SRC_FILES if not os.path.isfile(os.path.join(SRC_DIR, f))]
    if missing:
        sys.exit(f"missing {missing} in {SRC_DIR}: apt-get install -y fortunes")
    fortunes = []
    for name in SRC_FILES:
        with open(os.path.join(SRC_DIR, name), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            print(f"warning: {name} is not valid UTF-8 ({e}); replacing bad bytes")
            text = raw.decode("utf-8", errors="replace")
        cur = []
        for line in text.split("\n") + ["%"]:
            if line == "%":
                doc = "\n".join(cur).rstrip()
                if doc:
                    fortunes.append(doc)
                cur = []
            else:
                cur.append(line)
    return fortunes


def write_tokens(path, toks):
    """llm.c tokens file: 256 int32 header (magic, version, count), uint16 LE."""
    assert max(toks) < 2**16
    a = array("H", toks)
    if sys.byteorder == "big":
        a.byteswap()
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
        f.write(a.tobytes())


def write_tokenizer(path, ranks):
    """llm.c tokenizer file: 256 int32 header, then per id a length byte + bytes."""
    by_id = {i: b for b, i in ranks.items()}
    by_id[EOT] = b"<|endoftext|>"
    assert sorted(by_id) == list(range(VOCAB)), "ranks file is not GPT-2's"
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240328, 2, VOCAB, EOT, *([0] * 252)))
        for i in range(VOCAB):
            b = by_id[i]
            assert 1 <= len(b) <= 255
            f.write(bytes([len(b)]) + b)


def build(out_dir, enc):
    t0 = time.time()
    fortunes = read_fortunes()
    train, val, nval = [], [], 0
    for i, doc in enumerate(fortunes):
        dst = val if i % VAL_EVERY == VAL_EVERY - 1 else train
        nval += dst is val
        dst.append(EOT)  # every document starts with <|endoftext|>, as in llm.c
        dst.extend(enc.encode(doc))
    os.makedirs(out_dir, exist_ok=True)
    write_tokens(os.path.join(out_dir, OUT_NAMES[0]), train)
    write_tokens(os.path.join(out_dir, OUT_NAMES[1]), val)
    write_tokenizer(os.path.join(out_dir, OUT_NAMES[2]), enc.ranks)
    print(f"{len(fortunes)} fortunes from {len(SRC_FILES)} files: "
          f"train {len(fortunes) - nval} docs {len(train)} tokens, "
          f"val {nval} docs {len(val)} tokens, "
          f"{len(enc.cache)} distinct pieces, {time.time() - t0:.1f}s")


def read_or_none(path):
    return open(path, "rb").read() if os.path.exists(path) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="rebuild in a temp dir and compare with the committed files")
    ap.add_argument("--selftest", action="store_true", help="only test the tokenizer")
    args = ap.parse_args()
    t0 = time.time()
    enc = Encoder(load_ranks(RANKS_PATH))
    selftest(enc)
    enc.cache.clear()  # build from a cold cache so timings mean the same every run
    if args.selftest:
        return
    if not args.check:
        build(OUT_DIR, enc)
        for name in OUT_NAMES:
            p = os.path.join(OUT_DIR, name)
            print(f"wrote {os.path.relpath(p)} ({os.path.getsize(p)} bytes)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            build(tmp, enc)
            bad = [n for n in OUT_NAMES if read_or_none(os.path.join(OUT_DIR, n))
                   != read_or_none(os.path.join(tmp, n))]
        for n in bad:
            print(f"DIFFERS: {os.path.relpath(os.path.join(OUT_DIR, n))} (missing or stale)")
        if bad:
            sys.exit(f"check FAILED: {len(bad)} file(s) differ; rerun without --check")
        print(f"check ok: {len(OUT_NAMES)} files identical")
    print(f"total {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
