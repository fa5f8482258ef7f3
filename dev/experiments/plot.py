"""plot.py OUT.png TITLE LOG...: train loss (mean of a window of steps), val loss, and both zoomed on
what separates the runs (the val loss after the first evaluation; each run's train loss minus the
first run's, the reference), through gnuplot. Logs that are missing or hold no steps (skipped runs)
are left out."""
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


def smoothed(r):
    """{step: the mean of the window(r) train losses ending at it}."""
    w, losses = window(r), [x for _, x in r['train']]
    return {r['train'][i][0]: mean(losses[i - w + 1:i + 1]) for i in range(w - 1, len(losses))}


def plot(out, title, runs, tmp):
    # The y range ends a little above the highest start, so that a diverged run leaves the plot
    # instead of squashing the others (its numbers are on the results page).
    top, low = 0.0, math.inf
    train_plots, val_plots = [], []
    for k, r in enumerate(runs):
        w = window(r)
        losses = [x for _, x in r['train']]
        tfile, vfile = os.path.join(tmp, f'{k}.train'), os.path.join(tmp, f'{k}.val')
        with open(tfile, 'w') as f:
            f.writelines(f'{s} {fmt(x)}\n' for s, x in smoothed(r).items())
        with open(vfile, 'w') as f:
            for s, x in r['val']:
                f.write(f'{s} {fmt(x)}\n')
        finite = [x for x in losses[:w] + [x for s, x in r['val'] if s == 0] if math.isfinite(x)]
        top = max(top, max(finite, default=0.0))
        low = min([low] + [x for x in losses + [x for _, x in r['val']] if math.isfinite(x)])
        train_plots.append(f"'{tfile}' using 1:2 with lines lw 2 lc rgb '{COLORS[k % len(COLORS)]}' dt {k % 4 + 1} title '{r['name']}'")
        val_plots.append(f"'{vfile}' using 1:2 with linespoints lw 2 pt 7 ps 0.6 lc rgb '{COLORS[k % len(COLORS)]}' dt {k % 4 + 1} title '{r['name']}'")
    # The zooms: the val loss from the first evaluation after step 0, up to a little above the
    # reference's highest there; the train-loss difference within the spread of the runs that did
    # not diverge (the median run's largest difference, x 1.5), so that one diverging run does not
    # flatten the others.
    ref, later = runs[0], [s for s, _ in runs[0]['val'] if s > 0]
    zoom_plots, diff_plots, diffs = [], [], []
    if later:
        vals = [x for r in runs for s, x in r['val'] if s >= later[0] and math.isfinite(x)]
        ref_vals = [x for s, x in ref['val'] if s >= later[0] and math.isfinite(x)]
        zlo, zhi = min(vals), max(ref_vals, default=max(vals))
        zoom_plots = val_plots
    base = smoothed(ref)
    for k, r in enumerate(runs[1:], 1):
        d = [(s, x - base[s]) for s, x in smoothed(r).items() if s in base]
        fin = [abs(x) for _, x in d if math.isfinite(x)]
        diffs.append(max(fin, default=0.0))
        dfile = os.path.join(tmp, f'{k}.diff')
        with open(dfile, 'w') as f:
            f.writelines(f'{s} {fmt(x)}\n' for s, x in d)
        diff_plots.append(f"'{dfile}' using 1:2 with lines lw 2 lc rgb '{COLORS[k % len(COLORS)]}' dt {k % 4 + 1} title '{r['name']}'")
    span = max(0.02, 1.5 * sorted(diffs)[len(diffs) // 2]) if diffs else 1.0
    w = window(runs[0])
    panels = 2 + bool(zoom_plots) + bool(diff_plots)
    script = f"""
set terminal pngcairo noenhanced size 1500,{560 if panels <= 2 else 1040} font ',11'
set output '{out}'
set datafile missing 'NaN'
set grid
set key top right
set xlabel 'step'
set ylabel 'loss'
set yrange [*:{top + max(0.02, 0.05 * (top - low)):.3f}]
set multiplot layout {1 if panels <= 2 else 2},2 title '{title}'
set title 'train loss (mean of {w} steps)'
plot {', '.join(train_plots)}
set title 'val loss'
plot {', '.join(val_plots)}
"""
    if zoom_plots:
        script += f"""set title 'val loss from step {later[0]} (zoom)'
set xrange [{later[0]}:*]
set yrange [{zlo - 0.01:.3f}:{zhi + 0.1 * (zhi - zlo) + 0.01:.3f}]
plot {', '.join(zoom_plots)}
set xrange [*:*]
"""
    if diff_plots:
        script += f"""set title 'train loss minus that of {ref['name']} (mean of {w} steps)'
set ylabel 'loss difference'
set yrange [{-span:.3f}:{span:.3f}]
plot {', '.join(diff_plots)}, 0 with lines lc rgb '#000000' dt 2 notitle
"""
    script += "unset multiplot\n"
    subprocess.run(['gnuplot'], input=script, text=True, check=True)


main()
