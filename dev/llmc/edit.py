"""dev/llmc/edit.py EDITS FILE — applies the edits of EDITS to FILE, all or none.

EDITS: blocks separated by lines "@@ before|after|replace <a line of FILE, exactly>"; the lines
that follow (up to the next "@@" line) go before or after that line, or replace it. Every anchor
must be found exactly once in FILE, or nothing is written and the script exits 1 naming it.
"""
import sys

def parse(text):
    edits = []
    for line in text.splitlines():
        if line.startswith("@@ "):
            how, anchor = line[3:].split(" ", 1)
            edits.append((how, anchor, []))
        elif edits:
            edits[-1][2].append(line)
    return edits

def main(edits_path, target_path):
    lines = open(target_path).read().split("\n")
    edits = parse(open(edits_path).read())
    for how, anchor, body in edits:
        found = [i for i, l in enumerate(lines) if l == anchor]
        if len(found) != 1 or how not in ("before", "after", "replace"):
            sys.exit(f"edit.py: '{anchor}' found {len(found)} times in {target_path} (needs exactly 1); nothing changed")
    for how, anchor, body in edits:
        i = lines.index(anchor)
        if how == "before": lines[i:i] = body
        elif how == "after": lines[i + 1:i + 1] = body
        else: lines[i:i + 1] = body
    open(target_path, "w").write("\n".join(lines))

if __name__ == "__main__":
    main(*sys.argv[1:3])
