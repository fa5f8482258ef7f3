"""clip_results.py [DIR] [--print]: the page DIR.md on global-norm clipping under gradient release, from
the logs of clip_release.sh (DIR/logs/clip_release/) and release_cost.sh (DIR/logs/release_cost/; default
DIR: dev/results/clipping): a table and a plot (DIR/plots/clip_release_<setting>.png, gnuplot) per setting
(model, B, T, learning rate), and the cost table. --print also prints the tables. Every number is read
from a log. Standard library only."""
import glob
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logparse import mean, parse  # noqa: E402

ARGS = [a for a in sys.argv[1:] if not a.startswith('--')]
OUT = os.path.normpath(ARGS[0] if ARGS else 'dev/results/clipping')
LOGS = os.path.join(OUT, 'logs', 'clip_release')
COST = os.path.join(OUT, 'logs', 'release_cost')
MD = OUT + '.md'                    # the page sits beside its folder: clipping.md links clipping/...
LINK = os.path.basename(OUT)        # the folder as the page's links name it
PLOTS = os.path.join(OUT, 'plots')
KEEP = '<!-- clip_results.py keeps what follows this line -->'
RULES = ['exact', 'prev_release', 'noclip_release', 'est_release']
ABOUT = {'exact': 'exact clipping without release (`-R 0 -N exact -g 1`): the reference',
         'prev_release': 'release clipped with the previous step\'s norm (`-R 1 -N prev -g 1`)',
         'noclip_release': 'release unclipped (`-R 1 -g 0`): release without any clipping rule',
         'est_release': 'release clipped with this step\'s norm estimated layer by layer (`-R 1 -N est -g 1`, '
                        'the default under release)'}
COLORS = {'exact': '#000000', 'prev_release': '#1f77b4', 'noclip_release': '#d62728', 'est_release': '#2ca02c'}
NAME = re.compile(r'^(\w+?)_(d\d+\w*)_lr([^_]+)_s(\d+)$')
CLIPPED = re.compile(r'^clip\s.*: (\d+) of (\d+) steps clipped', re.M)
RECORD = re.compile(r'^(\w+) (\d+)x(\d+) round (\d+): speed\s+(\d+) tokens/s', re.M)   # release_cost.sh's stdout
COST_FLAGS = {'exact': '-R 0 -N exact -g 1', 'noclip_release': '-R 1 -g 0', 'prev_release': '-R 1 -N prev -g 1'}   # as release_cost.sh runs them
SMOOTH = 50   # steps in the train-loss mean of the plot


def load(path):
    r = parse(path)
    m = NAME.match(r['name'])
    if not m or m[1] not in RULES or r['final_val'] is None or not r['complete']:
        return None
    r['rule'], r['seed'] = m[1], int(m[4])
    f = r['flags']
    r['setting'] = (f.get('-e', m[2]), int(f.get('-b', 0)), int(f.get('-t', 0)), f.get('-l', m[3]), f.get('-n', '?'))
    with open(path, errors='replace') as fh:
        c = CLIPPED.search(fh.read())
    r['clipped'] = c[1] if c else '-'
    return r


def setting_name(s):
    return f'{s[0]}_b{s[1]}t{s[2]}_lr{s[3]}'


def where(runs):
    """The GPUs, dates and commits of these runs, from their headers."""
    gpus = sorted({(r['device'] or '?').replace('GPU ', '').replace(' (bf16 model)', '') for r in runs})
    dates = sorted(r['header'].get('date', '?')[:10] for r in runs)
    commits = sorted({r['header'].get('commit', '?') for r in runs})
    return f"{', '.join(gpus)}, {dates[0]}{'' if dates[0] == dates[-1] else ' to ' + dates[-1]}, " \
           f"commit {', '.join(f'`{c}`' for c in commits)}"


def verdict(vals, lo, hi):
    """A rule's mean against exact clipping's seed range [lo, hi]."""
    m = mean(vals)
    if m > hi:
        return f'**outside**: mean {m - hi:+.4f} above the exact max'
    if m < lo:
        return f'better: mean {m - lo:+.4f} below the exact min'
    return 'within'


def setting_table(s, runs):
    by = {rule: sorted((r for r in runs if r['rule'] == rule), key=lambda r: r['seed']) for rule in RULES}
    ex = [r['final_val'] for r in by['exact']]
    lo, hi = (min(ex), max(ex)) if ex else (None, None)
    md = [f"| {s[0]}, B={s[1]}, T={s[2]}, lr {s[3]}, {s[4]} steps | final val loss per seed | mean | "
          "spread (max-min) | mean vs exact's range | steps clipped |", '|---|---|---|---|---|---|']
    for rule in RULES:
        if not by[rule]:
            continue
        v = [r['final_val'] for r in by[rule]]
        vs = '—' if rule == 'exact' or lo is None or len(ex) < 2 else verdict(v, lo, hi)
        md.append(f"| {rule} | " + ' / '.join(f"{r['final_val']:.4f} (s{r['seed']})" for r in by[rule]) +
                  f" | {mean(v):.4f} | {max(v) - min(v):.4f} | {vs} | " +
                  ' / '.join(r['clipped'] if rule != 'noclip_release' else '-' for r in by[rule]) + ' |')
    return md, by


def fmt(x):
    return repr(x) if math.isfinite(x) else 'NaN'


def smooth_train(runs):
    """(steps, loss): the train loss as the mean of the seeds, then of SMOOTH steps (ending at each step)."""
    n = min(len(r['train']) for r in runs)
    per_step = [mean([r['train'][i][1] for r in runs]) for i in range(n)]
    steps = [runs[0]['train'][i][0] for i in range(SMOOTH - 1, n)]
    return steps, [mean(per_step[i - SMOOTH + 1:i + 1]) for i in range(SMOOTH - 1, n)]


def plot(s, by, png):
    """val loss per seed (thin) and per rule mean (thick) with exact's seed range as a band; a zoom on
    the last third; each rule's train loss minus exact's (smooth_train): the data order is the same for
    every seed and rule, so the curves themselves lie on each other."""
    if not any(by.values()):
        return
    with tempfile.TemporaryDirectory() as tmp:
        full, zoom, train, vals, curves = [], [], [], [], {}
        first = min(250, int(s[4]) // 6)   # the plots start here: the first losses would flatten the rest
        ex = by['exact']
        if len(ex) >= 2:
            band = os.path.join(tmp, 'band')
            with open(band, 'w') as f:
                for i, (step, _) in enumerate(ex[0]['val']):
                    xs = [r['val'][i][1] for r in ex if i < len(r['val'])]
                    f.write(f'{step} {fmt(min(xs))} {fmt(max(xs))}\n')
            b = f"'{band}' using 1:2:3 with filledcurves fc rgb '#bbbbbb' fs transparent solid 0.5 title 'exact: seed range'"
            full.append(b)
            zoom.append(b)
        for rule in RULES:
            runs = by[rule]
            if not runs:
                continue
            col = COLORS[rule]
            for r in runs:
                p = os.path.join(tmp, f"{rule}_{r['seed']}.val")
                with open(p, 'w') as f:
                    f.writelines(f'{step} {fmt(x)}\n' for step, x in r['val'])
                line = f"'{p}' using 1:2 with lines lw 1 lc rgb '{col}' notitle"
                full.append(line)
                zoom.append(line)
                vals += [x for step, x in r['val'] if step >= first]
            n = min(len(r['val']) for r in runs)
            p = os.path.join(tmp, f'{rule}.mean')
            with open(p, 'w') as f:
                for i in range(n):
                    f.write(f"{runs[0]['val'][i][0]} {fmt(mean([r['val'][i][1] for r in runs]))}\n")
            title = f"{rule} (mean of {len(runs)})"
            full.append(f"'{p}' using 1:2 with linespoints lw 3 pt 7 ps 0.8 lc rgb '{col}' title '{title}'")
            zoom.append(f"'{p}' using 1:2 with linespoints lw 3 pt 7 ps 0.8 lc rgb '{col}' title '{title}'")
            curves[rule] = smooth_train(runs)
        base = curves.get('exact')
        for rule, (steps, loss) in curves.items():
            if base is None or rule == 'exact':
                continue
            p = os.path.join(tmp, f'{rule}.train')
            with open(p, 'w') as f:
                f.writelines(f'{s_} {fmt(x - y)}\n' for s_, x, y in zip(steps, loss, base[1]))
            train.append(f"'{p}' using 1:2 with lines lw 2 lc rgb '{COLORS[rule]}' title '{rule}'")
        vals = [x for x in vals if math.isfinite(x)]
        last = [x for rule in RULES for r in by[rule] for step, x in r['val'] if step * 3 >= 2 * int(s[4])]
        last = [x for x in last if math.isfinite(x)]
        lo, hi = min(vals), max(vals)
        zlo, zhi = min(last), max(last)
        script = f"""
set terminal pngcairo noenhanced size 1800,560 font ',11'
set output '{png}'
set datafile missing 'NaN'
set grid
set key top right
set xlabel 'step'
set ylabel 'loss'
set multiplot layout 1,3 title 'Clipping under gradient release, flash AdamW, {s[0]}, B={s[1]}, T={s[2]}, lr {s[3]} (thin: seeds, thick: their mean)'
set title 'val loss'
set xrange [{first}:*]
set yrange [{lo - 0.02:.3f}:{hi + 0.02:.3f}]
plot {', '.join(full)}
set title 'val loss, last third (zoom)'
set key bottom left
set xrange [{2 * int(s[4]) // 3}:*]
set yrange [{zlo - 0.01:.3f}:{zhi + 0.01:.3f}]
plot {', '.join(zoom)}
set key top right
set title 'train loss minus exact clipping (each: mean of {SMOOTH} steps and of the seeds)'
set yrange [*:*]
set ylabel 'loss difference'
set xrange [{max(first, SMOOTH)}:*]
{'plot ' + ', '.join(train + ["0 with lines lc rgb '#000000' dt 2 title 'exact'"]) if train else ''}
unset multiplot
"""
        subprocess.run(['gnuplot'], input=script, text=True, check=True)


def cost_table():
    """release_cost.sh's runs: tokens/s and memory per shape and configuration, the median over its
    rounds, against exact clipping without release in the same shape."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(COST, '*.log'))):
        r = parse(path)
        if r['complete']:
            rule, shape = r['name'].rsplit('_r', 1)[0].rsplit('_', 1)
            r['round'] = int(r['name'].rsplit('_r', 1)[1])
            rows.setdefault(shape, {}).setdefault(rule, []).append(r)
    # the script's printed output (*.txt in a call's folder) for runs whose log did not come back: their speed only
    for path in sorted(glob.glob(os.path.join(COST, '*', '*.txt'))):
        for m in RECORD.finditer(open(path, errors='replace').read()):
            rule, shape, rnd = m[1], f'b{m[2]}t{m[3]}', int(m[4])
            logged = {r['round'] for r in rows.get(shape, {}).get(rule, [])}
            if rnd not in logged:
                rows.setdefault(shape, {}).setdefault(rule, []).append(
                    {'round': rnd, 'speed': float(m[5]), 'flags': {'-b': m[2], '-t': m[3]}, 'bpp': None, 'scratch': 0, 'mem': None})
    if not rows:
        return None, []
    order = ['exact', 'noclip_release', 'prev_release', 'est_release']
    md = ['| shape | run | flags | tokens/s per round | median | vs exact | persistent bytes/param | '
          'device memory (measured) |', '|---|---|---|---|---|---|---|---|']
    for shape in sorted(rows, key=lambda x: -int(x[1:].split('t')[0]) * int(x.split('t')[1])):
        by = rows[shape]
        base = statistics.median(r['speed'] for r in by['exact']) if 'exact' in by else None
        for n in [n for n in order if n in by] + sorted(n for n in by if n not in order):
            rs = sorted(by[n], key=lambda r: r['round'])
            logged = [r for r in rs if 'name' in r] or rs
            med = statistics.median(r['speed'] for r in rs)
            f = logged[0]['flags']
            flags = ' '.join(f'{k} {f[k]}' for k in ('-R', '-N', '-g') if k in f) or COST_FLAGS.get(n, '?')
            b = logged[0]['bpp']
            md.append(f"| B={f.get('-b', '?')}, T={f.get('-t', '?')} | {n} | `{flags}` | " +
                      ' / '.join(f"{r['speed']:.0f}" for r in rs) + f' | {med:.0f} | ' +
                      (f'{100 * (med / base - 1):+.1f}%' if base else '—') + ' | ' +
                      ('—' if b is None else f'{b:.3f}' + (f" (+ {logged[0]['scratch']:.3f} scratch)" if logged[0]['scratch'] else '')) +
                      ' | ' + (f"{logged[0]['mem'] / 1e9:.2f} GB" if logged[0]['mem'] else '—') + ' |')
    every = [r for by in rows.values() for rs in by.values() for r in rs if 'name' in r]
    return where(every), md


def main():
    runs = [r for r in (load(p) for p in sorted(glob.glob(os.path.join(LOGS, '*.log')))) if r]
    settings = sorted({r['setting'] for r in runs}, key=lambda s: (int(s[0][1:].split('c')[0] or 0), s[0], s[1], s[2], float(s[3])))
    md = ['# Clipping under gradient release\n',
          'Made by `dev/experiments/clip_results.py` from the logs of `dev/experiments/clip_release.sh` '
          f'(`{LINK}/logs/clip_release/`) and `release_cost.sh` (`{LINK}/logs/release_cost/`); every number below is read '
          'from them. Flash AdamW, warm-up 100, cosine to 10%, weight decay 0.1, StableEmbedding, the study corpus '
          '(`make corpus`), 3 seeds per rule. The rules:\n']
    md += [f'- `{rule}`: {ABOUT[rule]}' for rule in RULES]
    md.append('\nThe bar: with release, a clipping rule ends within the seed range of exact clipping (or '
              'below it), where release unclipped does not. "mean vs exact\'s range" compares a rule\'s mean '
              'over its seeds with the lowest and highest final val loss of the exact runs. The runs of a '
              'setting shared one GPU (several at a time), so their tokens/s are not speeds: the cost is measured '
              'below on its own.\n')
    printed = []
    for s in settings:
        these = [r for r in runs if r['setting'] == s]
        table, by = setting_table(s, these)
        png = os.path.join(PLOTS, f'clip_release_{setting_name(s)}.png')
        md.append(f'\n## {s[0]}, B={s[1]}, T={s[2]}, lr {s[3]}, {s[4]} steps\n')
        md.append(f'{where(these)}.\n')
        md += table
        try:
            os.makedirs(PLOTS, exist_ok=True)
            plot(s, by, png)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f'{png}: no plot ({e}; apt-get install -y gnuplot-nox)')
        if os.path.exists(png):
            md.append(f'\n![{os.path.basename(png)}]({LINK}/plots/{os.path.basename(png)})\n')
        printed += table + ['']
    md.append('\n## What release costs: tokens/s and memory\n')
    at, cost = cost_table()
    if cost:
        md.append('`dev/experiments/release_cost.sh`: d12, flash AdamW, one GPU, the runs one after '
                  f'another, interleaved over rounds ({at}). Tokens/s: the trainer\'s `speed` line (training '
                  'steps after the first, no evaluation).\n')
        md += cost
        printed += cost + ['']
    else:
        md.append('Not measured yet: `dev/experiments/release_cost.sh` makes these runs on one GPU.\n')
    kept = ''
    if os.path.exists(MD):
        with open(MD) as f:
            old = f.read()
        if KEEP in old:
            kept = old[old.index(KEEP) + len(KEEP):].lstrip('\n')
    md.append('\n' + KEEP + '\n' + kept)
    with open(MD, 'w') as f:
        f.write('\n'.join(md).rstrip('\n') + '\n')
    print(f'{MD}: {len(runs)} complete logs, {len(settings)} settings')
    if '--print' in sys.argv:
        print('\n'.join(printed))


main()
