#!/bin/sh
# test/check_layers.sh — the trainer's files call and include each other in layers, with no circle.
#
# Each C source is compiled to an object; nm gives the names each defines and the names it uses, and
# "A uses a name B defines" is an edge A -> B. Each `#include "..."` between the project's files is an
# edge too. A file and its header are one node (trainer/clip.c and trainer/clip.h are "clip"), so a
# file including its own header is no edge. The check fails, naming the circle, when the graph has one:
# a circle means two files can be read or changed only together, which is what the layers are for.
#
# usage: test/check_layers.sh [SOURCE...]   (default: the trainer's C sources and the library's,
#        with every header and CUDA file of the project for the include edges; run from the root)
# environment: CC (default cc), CFLAGS (default -O0), KEEP=1 keeps the objects and the edge list.
set -eu
CC=${CC:-cc}
CFLAGS=${CFLAGS:--O0}
if [ $# -eq 0 ]; then
    set -- train_gpt2_8bit.c trainer/*.c bnb8.c
fi
tmp=$(mktemp -d)
[ "${KEEP:-}" = 1 ] || trap 'rm -rf "$tmp"' EXIT

node() { b=${1##*/}; echo "${b%.*}"; }   # trainer/clip.c, trainer/clip.h -> clip

# Calls: an object per source, its defined and used names.
for src in "$@"; do
    n=$(node "$src")
    $CC $CFLAGS -std=c11 -I. -c "$src" -o "$tmp/$n.o"
    nm "$tmp/$n.o" | awk -v n="$n" '$1 ~ /^[UwvV]$/ && NF == 2 { print "use", n, $2 }
                                       NF == 3 && $2 ~ /^[TDBRCGSVW]$/ { print "def", n, $3 }' >> "$tmp/names"
done
awk '$1 == "def" { def[$3] = $2 } $1 == "use" { use[NR] = $2 " " $3 }
     END { for (k in use) { split(use[k], u, " "); if ((u[2] in def) && def[u[2]] != u[1]) print u[1], def[u[2]], "calls " u[2] } }' \
    "$tmp/names" | sort -u > "$tmp/edges"

# Includes: every project file's #include "..." of another project file.
for f in train_gpt2_8bit.c trainer/*.c trainer/*.h trainer/*.cu bnb8.c bnb8.h bnb8_cuda.cu; do
    [ -f "$f" ] || continue
    sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f" | while read -r h; do
        [ "$(node "$f")" = "$(node "$h")" ] || echo "$(node "$f") $(node "$h") includes $h"
    done
done | sort -u >> "$tmp/edges"
[ "${KEEP:-}" = 1 ] && echo "check_layers: objects and edges in $tmp"

# A circle: depth-first search over the nodes, printing the first back edge's path.
awk '
    { if (!(($1, $2) in seen)) { seen[$1, $2] = 1; adj[$1] = adj[$1] " " $2; why[$1, $2] = $3 " " $4 }
      nodes[$1] = 1; nodes[$2] = 1 }
    function visit(v,    k, m, list, w, i, s) {
        state[v] = 1; stack[++depth] = v
        m = split(adj[v], list, " ")
        for (k = 1; k <= m; k++) {
            w = list[k]
            if (state[w] == 1) {
                s = ""
                for (i = 1; i <= depth; i++) if (stack[i] == w) break
                for (; i <= depth; i++) s = s stack[i] " -> "
                print "check_layers: a circle between the trainer'"'"'s files: " s w
                for (i = 1; i <= depth; i++) if (stack[i] == w) break
                for (; i <= depth; i++) print "  " stack[i] " -> " (i < depth ? stack[i + 1] : w) ": " why[stack[i], (i < depth ? stack[i + 1] : w)]
                found = 1
                return 1
            }
            if (!state[w] && visit(w)) return 1
        }
        state[v] = 2; depth--
        return 0
    }
    END {
        for (v in nodes) if (!state[v] && visit(v)) exit 1
        n = 0; for (v in nodes) n++
        e = 0; for (k in seen) e++
        print "check_layers: " e " edges between " n " files, no circle"
    }' "$tmp/edges"
