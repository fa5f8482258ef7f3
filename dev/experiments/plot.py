"""plot.py OUT.png TITLE LOG...: train loss (mean of a window of steps) and val loss of these runs,
side by side, through gnuplot. Logs that are missing or hold no steps (skipped runs) are left out."""
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logparse import mean, parse, window  # noqa: E402


COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#17becf']   # distinct on white


def fmt(x):
    return repr(x) if math.isfinite(x) else 'NaN'


def main():
    out, title, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    runs = [parse(p) for p in paths if os.path.exists(p)]
    runs = [r for r in runs if r['train']]
    if not runs:
        print(f'{out}: no run with steps, no plot')
        return
    with tempfile.TemporaryDirectory() as tmp:
        plot(out, title, runs, tmp)
    print(f'{out}: {len(runs)} runs')


def plot(out, title, runs, tmp):
    # The y range ends a little above the highest start, so that a diverged run leaves the plot
    # instead of squashing the others (its numbers are in RESULTS.md).
    top, low = 0.0, math.inf
    train_plots, val_plots = [], []
    for k, r in enumerate(runs):
        w = window(r)
        losses = [x for _, x in r['train']]
        tfile, vfile = os.path.join(tmp, f'{k}.train'), os.path.join(tmp, f'{k}.val')
        with open(tfile, 'w') as f:
            for i in range(w - 1, len(losses)):   # the mean of the w steps ending at step i + 1
                f.write(f"{r['train'][i][0]} {fmt(mean(losses[i - w + 1:i + 1]))}\n")
        with open(vfile, 'w') as f:
            for s, x in r['val']:
                f.write(f'{s} {fmt(x)}\n')
        finite = [x for x in losses[:w] + [x for s, x in r['val'] if s == 0] if math.isfinite(x)]
        top = max(top, max(finite, default=0.0))
        low = min([low] + [x for x in losses + [x for _, x in r['val']] if math.isfinite(x)])
        train_plots.append(f"'{tfile}' using 1:2 with lines lw 2 lc rgb '{COLORS[k % len(COLORS)]}' dt {k % 4 + 1} title '{r['name']}'")
        val_plots.append(f"'{vfile}' using 1:2 with linespoints lw 2 pt 7 ps 0.6 lc rgb '{COLORS[k % len(COLORS)]}' dt {k % 4 + 1} title '{r['name']}'")
    w = window(runs[0])
    script = f"""
set terminal pngcairo noenhanced size 1500,560 font ',11'
set output '{out}'
set datafile missing 'NaN'
set grid
set key top right
set xlabel 'step'
set ylabel 'loss'
set yrange [*:{top + max(0.02, 0.05 * (top - low)):.3f}]
set multiplot layout 1,2 title '{title}'
set title 'train loss (mean of {w} steps)'
plot {', '.join(train_plots)}
set title 'val loss'
plot {', '.join(val_plots)}
unset multiplot
"""
    subprocess.run(['gnuplot'], input=script, text=True, check=True)


main()
