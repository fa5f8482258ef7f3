#!/usr/bin/env bash
# regen.sh: the plots, RESULTS.md and CLIP_RESULTS.md from the logs in the tree; trains nothing (safe
# where a trainer binary is built: run_all.sh with a binary would make runs, or skip logs for flags the
# binary lacks). Needs gnuplot for the plots (apt-get install -y gnuplot-nox). Prints the README's
# table of the studies (results.py --readme) and the tables of P14 (clip_results.py --print).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
for s in study1_recipes study3_seeds study2_ablations study4_scale; do EXP_PLOT_ONLY=1 bash "dev/experiments/$s.sh"; done
python3 dev/experiments/results.py dev/experiments --readme
python3 dev/experiments/clip_results.py dev/experiments/clip_release_logs --print
