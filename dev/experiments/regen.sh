#!/usr/bin/env bash
# regen.sh: the results pages and plots under dev/results/ from the logs there; trains nothing (safe
# where a trainer binary is built: run_all.sh with a binary would make runs, or skip logs for flags the
# binary lacks). Needs gnuplot for the plots (apt-get install -y gnuplot-nox). Prints the README's
# table of the studies (results.py --readme) and the clipping tables (clip_results.py --print).
# The two earlier series (studies_h200_b8t64, studies_cpu_pilot) get their pages again, not their plots:
# the study scripts' plot lists name the runs of dev/results/studies.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
for s in study1_recipes study3_seeds study2_ablations study4_scale study5_lean; do EXP_PLOT_ONLY=1 bash "dev/experiments/$s.sh"; done
python3 dev/experiments/results.py dev/results/studies --readme
python3 dev/experiments/results.py dev/results/studies_h200_b8t64
python3 dev/experiments/results.py dev/results/studies_cpu_pilot
python3 dev/experiments/clip_results.py dev/results/clipping --print
