#!/bin/sh
# test/check_docs.sh TRAINER ROOT: the docs against the tree, so that they cannot go stale.
#
#   sh test/check_docs.sh build/train_gpt2_8bit .
#
# 1. Sections: every "DESIGN.md §N" or "§N.N" cited in the tree's sources, scripts and pages is a
#    heading of DESIGN.md ("## §N ..." or "### §N.N ..."). A § that follows a mention of SPEC on its
#    line cites the specification instead and is not checked.
# 2. Samples: a code block in README.md or doc/*.md that follows a line
#        <!-- sample: ARGS -->
#    is the output of `TRAINER ARGS`, run in ROOT. The script runs it and checks that the sample's
#    lines appear in the real output, in order, with every number read as a placeholder (the
#    numbers of a short check run differ from those of the run the page shows) and runs of spaces as
#    one. A sample line "..." stands for any number of lines and is not checked. ARGS may differ
#    from the command the page shows, to keep the check run short (fewer steps, one val batch);
#    they may name $tmp, a fresh folder, whose path is then taken out of the output (-o $tmp/out
#    prints as "out").
# 3. Links: every relative link [text](path) of README.md, DESIGN.md and doc/*.md names a file or
#    folder of the tree.
#
# Portable sh and awk. Each failure names file:line; the exit status is 0 when everything is
# current, 1 otherwise.
set -u
if [ $# -ne 2 ]; then
    echo "usage: sh test/check_docs.sh TRAINER ROOT   (e.g. build/train_gpt2_8bit .)" >&2
    exit 2
fi
trainer=$1
root=$2
case $trainer in /*) ;; *) trainer=$(pwd)/$trainer ;; esac
cd "$root" || exit 2
LC_ALL=C
export LC_ALL
# The trainer's OpenMP threads sleep when they wait instead of spinning: on cores that other jobs
# share, spinning makes a short run several times slower.
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
export OMP_WAIT_POLICY
tmp=$(mktemp -d "${TMPDIR:-/tmp}/check_docs.XXXXXX") || exit 2
keep=0
trap 'if [ $keep = 0 ]; then rm -rf "$tmp"; fi' 0
trap 'exit 2' INT TERM
failed=0

# The tree's files: git's list (tracked and untracked, ignored ones left out) when there is one.
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    git ls-files --cached --others --exclude-standard > "$tmp/all"
else
    find . \( -name build -o -name '.?*' \) -prune -o -type f -print | sed 's|^\./||' > "$tmp/all"
fi
grep -E '(\.(c|h|cu|cuh|sh|py|md)|^Makefile|^\.ci/run)$' "$tmp/all" | while read -r f; do
    [ -f "$f" ] && printf '%s\n' "$f"
done > "$tmp/files"
pages="README.md DESIGN.md"
for f in doc/*.md; do [ -f "$f" ] && pages="$pages $f"; done

# ---- 1. every DESIGN.md § reference is a heading of DESIGN.md -----------------------------------
if [ ! -f DESIGN.md ]; then
    echo "check_docs: DESIGN.md not found in $(pwd)"
    exit 1
fi
sed -n 's/^##* §\([0-9][0-9.]*\).*/\1/p' DESIGN.md > "$tmp/sections"
# shellcheck disable=SC2046
awk -v sections="$tmp/sections" '
    BEGIN { while ((getline s < sections) > 0) have[s] = 1; bad = 0 }
    # where the last "what" starts in s, or 0
    function last(s, what,    at, p) {
        at = 0
        while ((p = index(s, what)) > 0) { at += p; s = substr(s, p + 1) }
        return at
    }
    /§/ {
        line = $0; done = 0
        while (match(line, /§[0-9]+(\.[0-9]+)*/)) {
            ref = substr(line, RSTART, RLENGTH); sub(/^§/, "", ref)
            before = substr($0, 1, done + RSTART - 1)
            spec = last(before, "SPEC"); design = last(before, "DESIGN")
            if (!(spec > design) && !(ref in have)) {
                printf "%s:%d: DESIGN.md §%s is not a section of DESIGN.md (no heading \"§%s\")\n", FILENAME, FNR, ref, ref
                bad++
            }
            done += RSTART + RLENGTH - 1
            line = substr(line, RSTART + RLENGTH)
        }
    }
    END { exit bad > 0 }
' $(cat "$tmp/files") || failed=1

# ---- 2. the sample outputs against a real run ----------------------------------------------------
# Each sample: $tmp/sample.K holds "LINE<tab>TEXT" for every line of the block, $tmp/where.K its
# page, $tmp/args.K the trainer's arguments.
# shellcheck disable=SC2086
awk -v dir="$tmp" '
    FNR == 1 { inblock = 0; want = 0 }
    /^<!-- sample:.*-->[ \t]*$/ {
        args = $0; sub(/^<!-- sample:[ \t]*/, "", args); sub(/[ \t]*-->[ \t]*$/, "", args)
        k++; want = 1
        printf "%s", args > (dir "/args." k); close(dir "/args." k)
        printf "%s:%d", FILENAME, FNR > (dir "/where." k); close(dir "/where." k)
        printf "%s", FILENAME > (dir "/page." k); close(dir "/page." k)
        printf "" > (dir "/sample." k)
        next
    }
    want && /^```/ { want = 0; inblock = 1; next }
    inblock && /^```/ { inblock = 0; close(dir "/sample." k); next }
    inblock { printf "%d\t%s\n", FNR, $0 >> (dir "/sample." k) }
    END { print k + 0 > (dir "/count") }
' $pages
count=$(cat "$tmp/count")

# The comparison: both sides with numbers as "#", a byte unit after a number as "B", runs of
# blanks as one, no blanks at either end; the output without the path of $tmp.
# shellcheck disable=SC2016 # an awk program: its $ are awk's
compare='
    function norm(s) {
        gsub(/[-+]?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/, "#", s)
        gsub(/# +[kMGT]?B/, "# B", s)
        gsub(/[ \t]+/, " ", s); sub(/^ /, "", s); sub(/ $/, "", s)
        return s
    }
    FILENAME == ARGV[1] {
        line = $0
        while ((p = index(line, strip)) > 0) line = substr(line, 1, p - 1) substr(line, p + length(strip))
        n++; out[n] = norm(line); next
    }
    {
        tab = index($0, "\t"); at = substr($0, 1, tab - 1); text = substr($0, tab + 1)
        want = norm(text)
        if (want == "...") next
        checked++
        while (i < n && out[i + 1] != want) i++
        if (i >= n) {
            printf "%s:%d: this line of the sample %s is not in the output, in this order: %s\n", page, at, where, text
            printf "    as compared: %s\n", want
            exit 1
        }
        i++
    }
    END { if (!checked && !i) { printf "%s: the sample has no line to check\n", where; exit 1 } }
'
k=1
while [ "$k" -le "$count" ]; do
    args=$(cat "$tmp/args.$k")
    where=$(cat "$tmp/where.$k")
    page=$(cat "$tmp/page.$k")
    if [ ! -x "$trainer" ]; then
        echo "$where: no trainer to run ($trainer)"
        failed=1
        break
    fi
    if ! eval "\"\$trainer\" $args" > "$tmp/out.$k" 2>&1; then
        echo "$where: the sample's run failed: $trainer $args"
        tail -n 5 "$tmp/out.$k" | sed 's/^/    /'
        failed=1
    elif ! awk -v where="$where" -v page="$page" -v strip="$tmp/" "$compare" "$tmp/out.$k" "$tmp/sample.$k"; then
        echo "    the run: $trainer $args; its output: $tmp/out.$k"
        keep=1
        failed=1
    fi
    k=$((k + 1))
done

# ---- 3. relative links of the pages name files of the tree ---------------------------------------
for page in $pages; do
    awk '{
        line = $0
        while (match(line, /\]\([^)]+\)/)) {
            target = substr(line, RSTART + 2, RLENGTH - 3)
            line = substr(line, RSTART + RLENGTH)
            if (target ~ /^[a-z]+:/ || target ~ /^#/) continue
            sub(/#.*/, "", target); sub(/[ \t].*/, "", target)
            print FNR "\t" target
        }
    }' "$page" | while IFS='	' read -r at target; do
        dir=$(dirname "$page")
        if [ ! -e "$dir/$target" ]; then
            echo "$page:$at: the link to $target names no file of the tree"
            echo x >> "$tmp/badlinks"
        fi
    done
done
[ -f "$tmp/badlinks" ] && failed=1

if [ $failed = 0 ]; then
    echo "check_docs: DESIGN.md references, $count sample output(s) and the pages' links are current"
fi
exit $failed
